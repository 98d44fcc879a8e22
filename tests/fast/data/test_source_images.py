"""Source images of editing prompts: read from JSONL (`image` or `images`, relative to the file), refused at start-up
with the file and line when missing, undecodable or in the wrong number, and loaded at the run's resolution."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
from PIL import Image

from miles.arguments.parser import default_args
from miles.data.shapes_edit import shapes_edit_item, write_shapes_edit_jsonl
from miles.data.source_images import load_source_image
from miles.rollout.data_source import PromptDataError, check_source_image_counts, read_prompt_file, sft_image_key

ARGS = default_args(input_key="prompt", metadata_key="metadata", source_image_range=(1, 2))


def write(tmp_path, rows, name="edits.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def pictures(tmp_path):
    (tmp_path / "img").mkdir()
    for k, colour in enumerate([(200, 10, 10), (10, 10, 200)]):
        Image.new("RGB", (48, 40), colour).save(tmp_path / "img" / f"{k}.png")
    (tmp_path / "img" / "broken.png").write_bytes(b"not a png")
    return tmp_path


def test_image_and_images_resolve_relative_to_the_file(pictures):
    path = write(
        pictures, [{"prompt": "a", "image": "img/0.png"}, {"prompt": "b", "images": ["img/0.png", "img/1.png"]}]
    )
    records = read_prompt_file(path, ARGS, source_images=True)
    assert records[0]["source_images"] == [str(pictures / "img" / "0.png")]
    assert records[1]["source_images"] == [str(pictures / "img" / "0.png"), str(pictures / "img" / "1.png")]
    check_source_image_counts(records, ARGS, "--prompt-data", path)


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"prompt": "a"}, r"edits\.jsonl:2: no source image"),
        ({"prompt": "a", "image": "img/missing.png"}, r"edits\.jsonl:2: source image 0 .*missing\.png not found"),
        ({"prompt": "a", "image": "img/broken.png"}, r"edits\.jsonl:2: source image 0 .*broken\.png is not a readable"),
        ({"prompt": "a", "image": "img/0.png", "images": ["img/1.png"]}, r"edits\.jsonl:2: .*not both"),
        ({"prompt": "a", "images": []}, r"edits\.jsonl:2: 'images' must be a non-empty list"),
    ],
)
def test_a_bad_source_image_is_refused_naming_the_file_and_line(pictures, row, message):
    path = write(pictures, [{"prompt": "ok", "image": "img/0.png"}, row])
    with pytest.raises(PromptDataError, match=message):
        read_prompt_file(path, ARGS, source_images=True)


def test_counts_and_builtin_worlds_must_match_the_family(pictures):
    three = write(pictures, [{"prompt": "a", "images": ["img/0.png"] * 3}])
    records = read_prompt_file(three, ARGS, source_images=True)
    with pytest.raises(PromptDataError, match=r"edits\.jsonl:1: 3 source image\(s\); this model takes 1 to 2"):
        check_source_image_counts(records, ARGS, "--prompt-data", three)
    with pytest.raises(PromptDataError, match="builtin:shapes holds text prompts"):
        check_source_image_counts([], ARGS, "--prompt-data", "builtin:shapes")
    text_family = argparse.Namespace(**{**vars(ARGS), "source_image_range": (0, 0)})
    with pytest.raises(PromptDataError, match="builtin:shapes-edit holds editing triples"):
        check_source_image_counts([], text_family, "--prompt-data", "builtin:shapes-edit")
    txt = pictures / "prompts.txt"
    txt.write_text("a red circle\n")
    with pytest.raises(PromptDataError, match=r"\.txt prompt file has no source images"):
        read_prompt_file(str(txt), ARGS, source_images=True)


def test_source_images_load_as_uint8_at_the_run_resolution(pictures):
    image = load_source_image(str(pictures / "img" / "0.png"), 32)
    assert image.shape == (32, 32, 3) and image.dtype == np.uint8
    assert tuple(image[16, 16]) == (200, 10, 10)
    array = np.zeros((32, 32, 3), np.uint8)
    assert load_source_image(array, 32) is array  # already at size: as it is
    with pytest.raises(ValueError, match=r"\(H, W, 3\) uint8"):
        load_source_image(np.zeros((32, 32), np.float32), 32)


def test_a_written_shapes_edit_file_reads_back_as_triples(tmp_path):
    path = write_shapes_edit_jsonl(tmp_path / "edits.jsonl", 3, seed=0)
    args = argparse.Namespace(**{**vars(ARGS), "image_key": None})
    records = read_prompt_file(str(path), args, image_key=sft_image_key(args, True), source_images=True)
    item = shapes_edit_item(0, "train", 0, target=True)
    assert records[0]["prompt"] == item["prompt"] and records[0]["metadata"] == item["metadata"]
    assert np.array_equal(load_source_image(records[0]["source_images"][0], 32), item["source_images"][0])
    assert np.array_equal(load_source_image(records[0]["image"], 32), np.asarray(item["image"]))  # the target
    assert sft_image_key(args, False) == "image"


def test_a_folder_of_pairs_reads_as_records_in_name_order(pictures):
    folder = pictures / "pairs"
    folder.mkdir()
    for name, colour in [("b", (0, 200, 0)), ("a", (200, 0, 0))]:
        (folder / f"{name}.txt").write_text(f"make the {name} shape blue\n")
        Image.new("RGB", (8, 8), colour).save(folder / f"{name}.png")
        Image.new("RGB", (8, 8), (0, 0, 200)).save(folder / f"{name}_target.jpg")
    (folder / "a.json").write_text('{"color": "blue"}')
    records = read_prompt_file(str(folder), ARGS, source_images=True)
    assert [r["prompt"] for r in records] == ["make the a shape blue", "make the b shape blue"]
    assert records[0]["source_images"] == [str(folder / "a.png")] and records[0]["metadata"] == {"color": "blue"}
    sft = read_prompt_file(str(folder), ARGS, image_key="target", source_images=True)
    assert sft[1]["image"] == str(folder / "b_target.jpg")
    (folder / "c.txt").write_text("make it red")
    with pytest.raises(PromptDataError, match=r"pairs: c\.txt: no source image c\{\.png"):
        read_prompt_file(str(folder), ARGS, source_images=True)
    with pytest.raises(PromptDataError, match="is a folder: a folder of .* pairs is for an editing"):
        read_prompt_file(str(folder), ARGS)
