"""Held-out shapes evaluation: identical repeated evals, metrics against an independent scoring of the returned
images, and the aggregation against dataset images (true scenes score ~100%, a wrong color scores 0 on color)."""

import dataclasses

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw
from PIL.ImageFont import load_default

from miles.data.ocr import ocr_prompts
from miles.data.shapes import ShapeScene, render_scene, shapes_items, shapes_prompts
from miles.models.conditioning import Conditioning
from miles.rollout.engine import DiffusionEngine
from miles.rollout.engine_api import GenerateRequest, GenerateResult
from miles.rollout.evaluation import eval_seed, evaluate_ocr, evaluate_shapes
from miles.rollout.rm_hub.shapes import score_shapes_image

ATTRIBUTES = ("color", "shape", "count", "position")


@pytest.fixture(scope="module")
def engine(tiny_pipeline_dir):
    return DiffusionEngine(tiny_pipeline_dir)


class FakeEngine:
    """Answers each request with the next images of a fixed stack, and records the requests."""

    def __init__(self, images: np.ndarray, fps: float | None = None, audio: torch.Tensor | None = None) -> None:
        self.images, self.used, self.requests = images, 0, []
        self.fps, self.audio = fps, audio

    def generate(self, request: GenerateRequest) -> GenerateResult:
        self.requests.append(request)
        batch = len(request.prompts)
        images = self.images[self.used : self.used + batch]
        audio = None if self.audio is None else self.audio[self.used : self.used + batch]
        self.used += batch
        empty = torch.zeros(batch, 0, 4, 8, 8)
        return GenerateResult(
            images=images,
            final_latents=torch.zeros(batch, 4, 8, 8),
            latents=empty,
            next_latents=empty,
            log_probs=torch.zeros(batch, 0),
            sigmas=torch.linspace(1, 0, request.num_steps + 1),
            trained_steps=[],
            conditioning=Conditioning({"prompt_embeds": torch.zeros(batch, 1, 1)}),
            negative=None,
            weights_version=0,
            fps=self.fps,
            audio=audio,
            sample_rate=None if audio is None else 16000,
        )


def test_repeated_evals_are_identical_and_batching_does_not_matter(engine):
    records = shapes_prompts(5, seed=3, split="eval")
    kwargs = dict(num_samples_per_prompt=2, num_steps=3, guidance_scale=3.0, seed=11)
    metrics_a, samples_a = evaluate_shapes(engine, records, batch_size=4, **kwargs)
    images_a = samples_a.images
    metrics_b, samples_b = evaluate_shapes(engine, records, batch_size=4, **kwargs)
    images_b = samples_b.images
    assert images_a.shape == (10, 32, 32, 3) and images_a.dtype == np.uint8
    assert np.array_equal(images_a, images_b) and metrics_a == metrics_b
    images_one_batch = evaluate_shapes(engine, records, batch_size=64, **kwargs)[1].images
    assert np.abs(images_a.astype(int) - images_one_batch.astype(int)).max() <= 1
    other_seed = evaluate_shapes(engine, records, batch_size=4, **{**kwargs, "seed": 12})[1].images
    assert not np.array_equal(images_a, other_seed)


def test_generator_eval_is_fixed_seed_and_one_step_matches_one_euler_step(engine):
    """A dmd2 run evaluates its k-step generator (renoise); at k = 1 that is one Euler step from σ = 1 to 0."""
    records = shapes_prompts(4, seed=3, split="eval")
    kwargs = dict(guidance_scale=1.0, seed=5)
    euler = evaluate_shapes(engine, records, num_steps=1, **kwargs)[1].images
    one = evaluate_shapes(engine, records, num_steps=1, sde_type="renoise", **kwargs)[1].images
    assert np.abs(euler.astype(int) - one.astype(int)).max() <= 1
    two_a = evaluate_shapes(engine, records, num_steps=2, sde_type="renoise", **kwargs)[1].images
    two_b = evaluate_shapes(engine, records, num_steps=2, sde_type="renoise", **kwargs)[1].images
    assert np.array_equal(two_a, two_b)  # the re-noising draws come from the fixed seeds too
    assert not np.array_equal(two_a, one)


def test_metrics_match_an_independent_scoring_of_the_images(engine):
    records = shapes_prompts(6, seed=0, split="eval")
    metrics, samples = evaluate_shapes(engine, records, num_samples_per_prompt=2, num_steps=2, guidance_scale=1.0)
    images = samples.images
    scores = [score_shapes_image(image, records[i // 2]["metadata"]) for i, image in enumerate(images)]
    assert metrics["eval/shapes_accuracy"] == pytest.approx(sum(s.all_correct for s in scores) / 12)
    assert metrics["eval/shapes_reward_mean"] == pytest.approx(sum(s.reward for s in scores) / 12)
    expected = {
        "color": [s.color > 0.5 for s in scores],
        "shape": [s.shape >= 0.5 for s in scores],
        "count": [s.count == 1.0 for s in scores],
        "position": [s.position >= 0.5 for s in scores],
    }
    for name, flags in expected.items():
        assert metrics[f"eval/shapes_{name}_accuracy"] == pytest.approx(sum(flags) / 12)


def test_requests_are_deterministic_ode_with_per_prompt_seeds():
    records = shapes_prompts(5, seed=0, split="eval")
    fake = FakeEngine(np.full((15, 32, 32, 3), 255, dtype=np.uint8))
    evaluate_shapes(fake, records, num_samples_per_prompt=3, num_steps=7, guidance_scale=4.5, seed=5, batch_size=4)
    assert [len(r.prompts) for r in fake.requests] == [4, 4, 4, 3]
    assert all(r.sde_type == "ode" and r.trained_steps == [] and r.noise_level == 0.0 for r in fake.requests)
    assert all(r.num_steps == 7 and r.guidance_scale == 4.5 for r in fake.requests)
    prompts = [p for r in fake.requests for p in r.prompts]
    seeds = [s for r in fake.requests for s in r.seeds]
    assert prompts == [r["prompt"] for r in records for _ in range(3)]
    assert seeds == [eval_seed(5, i, k) for i in range(5) for k in range(3)]
    assert len(set(seeds)) == 15


def test_true_dataset_images_score_about_all_correct():
    items = shapes_items(60, seed=0, split="eval")
    images = np.stack([np.asarray(item["image"]) for item in items])
    records = [{"prompt": item["prompt"], "metadata": item["metadata"]} for item in items]
    metrics, returned = evaluate_shapes(FakeEngine(images), records, num_steps=4, guidance_scale=1.0, batch_size=16)
    assert np.array_equal(returned.images, images) and returned.fps is None and returned.audio is None
    assert metrics["eval/shapes_accuracy"] >= 0.95
    for name in ATTRIBUTES:
        assert metrics[f"eval/shapes_{name}_accuracy"] >= 0.95, name


def test_a_wrong_color_fails_color_and_all_correct_only():
    items = shapes_items(20, seed=1, split="eval")
    records = [{"prompt": item["prompt"], "metadata": item["metadata"]} for item in items]
    rng = np.random.default_rng(0)
    recolored = []
    for item in items:
        scene = ShapeScene.from_metadata(item["metadata"])
        other = "green" if scene.color != "green" else "red"
        recolored.append(np.asarray(render_scene(dataclasses.replace(scene, color=other), rng)))
    metrics, _ = evaluate_shapes(FakeEngine(np.stack(recolored)), records, num_steps=4, guidance_scale=1.0)
    assert metrics["eval/shapes_accuracy"] == 0.0 and metrics["eval/shapes_color_accuracy"] == 0.0
    for name in ("shape", "count", "position"):
        assert metrics[f"eval/shapes_{name}_accuracy"] >= 0.9, name


def test_blank_images_score_zero():
    records = shapes_prompts(4, seed=0, split="eval")
    metrics, _ = evaluate_shapes(
        FakeEngine(np.full((4, 32, 32, 3), 255, dtype=np.uint8)), records, num_steps=4, guidance_scale=1.0
    )
    assert all(value == 0.0 for value in metrics.values())


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="at least one record"):
        evaluate_shapes(FakeEngine(np.zeros((0, 32, 32, 3), np.uint8)), [], num_steps=4, guidance_scale=1.0)
    with pytest.raises(ValueError, match="num_samples_per_prompt"):
        evaluate_shapes(
            FakeEngine(np.zeros((1, 32, 32, 3), np.uint8)),
            shapes_prompts(1, seed=0),
            num_samples_per_prompt=0,
            num_steps=4,
            guidance_scale=1.0,
        )


def test_video_is_scored_frame_by_frame_and_keeps_its_fps_and_audio():
    """Two true frames and one recolored: every attribute averages over frames, and all_correct fails."""
    items = shapes_items(6, seed=2, split="eval")
    records = [{"prompt": item["prompt"], "metadata": item["metadata"]} for item in items]
    rng = np.random.default_rng(0)
    videos = []
    for item in items:
        scene = ShapeScene.from_metadata(item["metadata"])
        other = np.asarray(
            render_scene(dataclasses.replace(scene, color="green" if scene.color != "green" else "red"), rng)
        )
        videos.append(np.stack([np.asarray(item["image"]), np.asarray(item["image"]), other]))
    videos = np.stack(videos)
    audio = torch.linspace(-1, 1, 6 * 2 * 100).reshape(6, 2, 100)
    engine = FakeEngine(videos, fps=8.0, audio=audio)
    metrics, samples = evaluate_shapes(engine, records, num_steps=2, guidance_scale=1.0, batch_size=4)
    frame_scores = [[score_shapes_image(f, r["metadata"]) for f in video] for video, r in zip(videos, records)]
    assert metrics["eval/shapes_accuracy"] == 0.0
    expected_reward = np.mean([np.mean([s.reward for s in scores]) for scores in frame_scores])
    assert metrics["eval/shapes_reward_mean"] == pytest.approx(expected_reward)
    expected_color = np.mean([np.mean([s.color for s in scores]) > 0.5 for scores in frame_scores])
    assert metrics["eval/shapes_color_accuracy"] == pytest.approx(expected_color) and expected_color > 0.5
    assert np.array_equal(samples.images, videos) and samples.fps == 8.0 and samples.sample_rate == 16000
    assert torch.equal(samples.audio, audio)


def test_ocr_eval_accuracy_is_the_rate_of_fully_read_targets():
    records = ocr_prompts("eval")[:2]  # "CLOSED" and "DINER" on a wooden sign
    images = np.full((4, 128, 256, 3), 255, np.uint8)  # two samples per prompt; only the first sample is written
    for i, record in enumerate(records):
        canvas = Image.new("RGB", (256, 128), (255, 255, 255))
        ImageDraw.Draw(canvas).text((40, 44), record["metadata"]["text"], fill=(0, 0, 0), font=load_default(size=40))
        images[2 * i] = np.asarray(canvas)
    fake = FakeEngine(images)
    metrics, samples = evaluate_ocr(fake, records, num_samples_per_prompt=2, num_steps=4, guidance_scale=1.0)
    assert metrics == {"eval/ocr_accuracy": 0.5, "eval/ocr_reward_mean": 0.5}  # read: 1, blank: 0
    assert [r.prompts for r in fake.requests] == [[records[0]["prompt"]] * 2 + [records[1]["prompt"]] * 2]
    assert np.array_equal(samples.images, images)
    with pytest.raises(ValueError, match="OCR eval scores images"):
        evaluate_ocr(FakeEngine(np.zeros((1, 2, 8, 8, 3), np.uint8)), records[:1], num_steps=4, guidance_scale=1.0)


def test_an_editing_eval_sends_each_prompts_source_and_scores_what_the_result_kept():
    """Each request carries its prompts' sources loaded at the resolution; `eval/edit_preservation_mean` is the
    masked PSNR score of each result against its source, computed here by hand."""
    from miles.data.shapes_edit import shapes_edit_items
    from miles.rollout.rm_hub.edit import PSNR_CAP_DB, keep_mask, masked_psnr

    records = shapes_edit_items(3, seed=0, split="eval", targets=True)
    sources = [r["source_images"][0] for r in records]
    results = np.stack([s for s in sources for _ in range(2)])  # each source copied: nothing changed
    results[1, :4] = 0  # one sample repaints a band, partly outside its edit box
    engine = FakeEngine(results)
    metrics, samples = evaluate_shapes(
        engine, records, num_samples_per_prompt=2, num_steps=2, guidance_scale=1.0, resolution=32, batch_size=4
    )
    sent = [image for request in engine.requests for images in request.source_images for image in images]
    assert all(np.array_equal(a, b) for a, b in zip(sent, [s for s in sources for _ in range(2)]))
    assert np.array_equal(samples.sources, np.stack([s for s in sources for _ in range(2)]))
    keep = keep_mask(32, 32, records[0]["metadata"]["edit_box"])
    expected = (5 + min(masked_psnr(results[1], sources[0], keep), PSNR_CAP_DB) / PSNR_CAP_DB) / 6
    assert metrics["eval/edit_preservation_mean"] == pytest.approx(expected, rel=1e-12) and expected < 1
    with pytest.raises(ValueError, match="pass the run's resolution"):
        evaluate_shapes(FakeEngine(results), records, num_steps=2, guidance_scale=1.0)
