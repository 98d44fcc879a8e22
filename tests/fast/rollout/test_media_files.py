"""Media files: mp4s read back with PyAV (frames, fps, the audio stream's length, a square that moves), contact
sheets, and the layout `save_media` writes for images and for video."""

from __future__ import annotations

import av
import numpy as np
import pytest
from PIL import Image

from miles.rollout.media_files import contact_frame_indices, contact_sheet, pad_to_even, save_media, write_mp4


def moving_square(num_frames: int, height: int = 32, width: int = 32, step: int = 2, size: int = 8) -> np.ndarray:
    """A white square on black moving `step` pixels right per frame (left for a negative step)."""
    frames = np.zeros((num_frames, height, width, 3), dtype=np.uint8)
    start = 2 if step > 0 else width - size - 2
    for t in range(num_frames):
        x = start + step * t
        frames[t, 12 : 12 + size, x : x + size] = 255
    return frames


def decoded(path: str) -> tuple[list[np.ndarray], float, int, int]:
    """(RGB frames, the video stream's average fps, audio samples decoded, audio sample rate) of an mp4."""
    with av.open(path) as container:
        fps = float(container.streams.video[0].average_rate)
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    samples, rate = 0, 0
    with av.open(path) as container:
        if container.streams.audio:
            rate = container.streams.audio[0].rate
            samples = sum(frame.samples for frame in container.decode(audio=0))
    return frames, fps, samples, rate


def centroid_x(frame: np.ndarray) -> float:
    ys, xs = np.nonzero(frame.mean(axis=-1) > 128)
    return float(xs.mean())


def test_mp4_with_audio_has_its_frames_fps_and_an_audio_stream_as_long_as_the_video(tmp_path):
    fps, rate, frames = 24.0, 48000, moving_square(12, step=2)
    seconds = len(frames) / fps
    t = np.arange(int(seconds * rate)) / rate
    audio = np.stack([0.5 * np.sin(2 * np.pi * 440 * t), 0.5 * np.sin(2 * np.pi * 660 * t)])
    path = write_mp4(str(tmp_path / "clip.mp4"), frames, fps, audio=audio, sample_rate=rate)
    with av.open(path) as container:
        video, sound = container.streams.video[0], container.streams.audio[0]
        assert (video.codec_context.name, video.codec_context.pix_fmt) == ("h264", "yuv420p")
        assert (sound.codec_context.name, sound.codec_context.channels) == ("aac", 2)
    out, out_fps, samples, out_rate = decoded(path)
    assert len(out) == 12 and out_fps == pytest.approx(fps) and out_rate == rate
    assert abs(samples / rate - seconds) <= 1 / fps  # AAC pads to its 1024-sample frames: well under a frame
    xs = [centroid_x(frame) for frame in out]
    expected = [2 + 2 * i + 3.5 for i in range(12)]  # the square's mean column in the input
    assert np.allclose(xs, expected, atol=0.6)


def test_mp4_without_audio_has_no_audio_stream_and_odd_sizes_are_padded(tmp_path):
    frames = moving_square(5, height=17, width=33)
    out, out_fps, samples, _ = decoded(write_mp4(str(tmp_path / "odd.mp4"), frames, 7.5))
    assert len(out) == 5 and out[0].shape == (18, 34, 3) and out_fps == pytest.approx(7.5) and samples == 0
    padded = pad_to_even(frames)
    assert np.array_equal(padded[:, 17, :33], frames[:, 16]) and np.array_equal(padded[:, :17, 33], frames[:, :, 32])
    assert np.abs(out[2].astype(int) - padded[2]).mean() < 4


@pytest.mark.parametrize(
    "frames,fps,audio,rate,match",
    [
        (np.zeros((4, 8, 8), np.uint8), 8, None, None, r"\(F >= 1, H, W, 3\).*shape \(4, 8, 8\)"),
        (np.zeros((4, 8, 8, 3), np.float32), 8, None, None, "uint8.*float32"),
        (np.zeros((0, 8, 8, 3), np.uint8), 8, None, None, r"shape \(0, 8, 8, 3\)"),
        (np.zeros((4, 8, 8, 3), np.uint8), 0, None, None, "positive finite.*got 0"),
        (np.zeros((4, 8, 8, 3), np.uint8), float("nan"), None, None, "positive finite"),
        (np.zeros((4, 8, 8, 3), np.uint8), 8, np.zeros(100), 16000, r"channels 1 or 2.*shape \(100,\)"),
        (np.zeros((4, 8, 8, 3), np.uint8), 8, np.zeros((1, 100)), None, "positive integer sample_rate"),
        (np.zeros((4, 8, 8, 3), np.uint8), 8, np.full((1, 100), np.nan), 16000, "NaN or inf"),
    ],
)
def test_bad_inputs_are_named(tmp_path, frames, fps, audio, rate, match):
    with pytest.raises(ValueError, match=match):
        write_mp4(str(tmp_path / "bad.mp4"), frames, fps, audio=audio, sample_rate=rate)


def test_contact_sheet_has_a_row_per_sample_of_evenly_spaced_frames(tmp_path):
    assert contact_frame_indices(9, 4) == [0, 3, 5, 8] and contact_frame_indices(2, 4) == [0, 1]
    videos = np.stack([moving_square(9, step=2), moving_square(9, step=-2)])
    sheet = np.asarray(Image.open(contact_sheet(videos, str(tmp_path / "sheet.png"))))
    assert sheet.shape == (2 * 32, 4 * 32, 3)
    for row in range(2):
        for col, frame in enumerate([0, 3, 5, 8]):
            assert np.array_equal(sheet[row * 32 : (row + 1) * 32, col * 32 : (col + 1) * 32], videos[row, frame])


def test_save_media_writes_a_grid_for_images_and_bounded_mp4s_plus_a_sheet_for_video(tmp_path):
    images = np.zeros((4, 8, 8, 3), np.uint8)
    assert save_media(str(tmp_path), "rollout_0000001", images, columns=2) == [
        str(tmp_path / "images" / "rollout_0000001.png")
    ]
    assert not (tmp_path / "media").exists()
    videos = np.stack([moving_square(6)] * 3)
    audio = np.zeros((3, 1, 8000), np.float32)
    paths = save_media(str(tmp_path), "eval_0000002", videos, fps=12, audio=audio, sample_rate=16000, max_samples=2)
    assert paths == [
        str(tmp_path / "media" / "eval_0000002" / "sample_0.mp4"),
        str(tmp_path / "media" / "eval_0000002" / "sample_1.mp4"),
        str(tmp_path / "images" / "eval_0000002.png"),
    ]
    assert sorted(p.name for p in (tmp_path / "media" / "eval_0000002").iterdir()) == ["sample_0.mp4", "sample_1.mp4"]
    _, _, samples, rate = decoded(paths[0])
    assert rate == 16000 and abs(samples / rate - 0.5) <= 1 / 12
    assert np.asarray(Image.open(paths[-1])).shape == (2 * 32, 4 * 32, 3)
    with pytest.raises(ValueError, match="has no fps"):
        save_media(str(tmp_path), "rollout_0000003", videos)
