"""Input files fail before any actor starts, naming FILE:LINE."""

from __future__ import annotations

import json
import logging

import pytest
from PIL import Image

import train_diffusion
from miles.arguments.parser import parse_args
from miles.rollout.data_source import PromptDataError
from miles.rollout.input_files import InputFileError, check_input_files, check_model_index


@pytest.fixture
def pipeline(tmp_path):
    folder = tmp_path / "pipe"
    folder.mkdir()
    return folder


def test_model_index_that_is_not_json_names_file_and_line(pipeline):
    (pipeline / "model_index.json").write_text('{\n  "_class_name": "StableDiffusion3Pipeline",\n  "vae": [\n')
    with pytest.raises(InputFileError, match=rf"{pipeline}/model_index\.json:4: not valid JSON .*--hf-checkpoint"):
        check_model_index(str(pipeline), "--hf-checkpoint")


def test_model_index_with_bad_bytes_names_file_and_line(pipeline):
    (pipeline / "model_index.json").write_bytes(b'{\n"_class_name": "x\xff"}\n')
    with pytest.raises(InputFileError, match=r"model_index\.json:2: not UTF-8 \(byte 0xff\) \(--teacher-load"):
        check_model_index(str(pipeline), "--teacher-load")


def test_missing_or_empty_model_folders_fail_before_any_rank_loads_them(pipeline):
    with pytest.raises(InputFileError, match=r"--teacher-load .*/missing: no such file or folder"):
        check_model_index(str(pipeline / "missing"), "--teacher-load")
    (pipeline / "file.txt").write_text("x")
    with pytest.raises(InputFileError, match=r"--critic-checkpoint .*file\.txt: not a folder"):
        check_model_index(str(pipeline / "file.txt"), "--critic-checkpoint")
    with pytest.raises(InputFileError, match=r"holds neither model_index\.json .* nor config\.json"):
        check_model_index(str(pipeline), "--teacher-load")
    (pipeline / "transformer").mkdir()
    (pipeline / "transformer" / "config.json").write_text("{}")
    check_model_index(str(pipeline), "--teacher-load")  # a transformer folder is a valid teacher


def test_an_unknown_builtin_checkpoint_names_the_known_ones():
    from miles.models.builtin import resolve_checkpoint

    with pytest.raises(
        ValueError, match=r"unknown built-in checkpoint 'builtin:tiny_shapes'; known: builtin:tiny-shapes"
    ):
        resolve_checkpoint("builtin:tiny_shapes")


def test_the_driver_checks_prompt_files_before_any_actor_starts(tmp_path, monkeypatch, tiny_pipeline_dir):
    """The checks run while Ray starts (`miles.startup.start_up`): a failed one stops the run before any actor, with
    Ray shut down, and is the error reported even when Ray failed too."""
    import ray

    import miles.startup
    from miles.ray.groups import RunGroups

    events = []
    monkeypatch.setattr(miles.startup, "ray_init_settings", lambda args: {"address": "local"})
    monkeypatch.setattr(ray, "init", lambda **kwargs: events.append("ray.init"))
    monkeypatch.setattr(ray, "shutdown", lambda: events.append("ray.shutdown"))
    monkeypatch.setattr(RunGroups, "launch", lambda args: pytest.fail("an actor group started"))
    data = tmp_path / "p.jsonl"
    data.write_bytes(b'{"prompt": "a"}\n{"prompt": "b\xc3"}\n')
    args = parse_args(["--hf-checkpoint", tiny_pipeline_dir, "--prompt-data", str(data), "--output-dir",
                       str(tmp_path / "out"), "--rollout-batch-size", "1", "--n-samples-per-prompt", "2"])  # fmt: skip
    with pytest.raises(PromptDataError, match=r"p\.jsonl:2: not UTF-8"):
        train_diffusion.run(args)
    assert events == ["ray.init", "ray.shutdown"]

    def ray_fails(**kwargs):
        raise ConnectionError("no cluster at that address")

    monkeypatch.setattr(ray, "init", ray_fails)
    data.write_text('{"prompt": "a"}\n')
    args.rollout_batch_size = 4
    with pytest.raises(PromptDataError, match=r"1 distinct prompt\(s\), fewer than --rollout-batch-size 4") as failed:
        train_diffusion.run(args)
    assert isinstance(failed.value.__context__, ConnectionError)  # Ray's error stays attached
    assert events == ["ray.init", "ray.shutdown"]  # nothing to shut down after a failed ray.init


def prompt_file(tmp_path, *rows):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


SOURCE_FAMILIES = "flux2, flux2-dev, flux-kontext, qwen-image-edit, qwen-image-edit-plus, wan-i2v"


def test_a_source_image_for_a_family_that_takes_none_is_refused_naming_field_and_families(tmp_path, tiny_pipeline_dir):
    """The issue's case: editing records given to a text-to-image model were silently read as text prompts."""
    Image.new("RGB", (8, 8)).save(tmp_path / "cat.png")
    data = prompt_file(tmp_path, {"prompt": "a"}, {"prompt": "make it red", "image": "cat.png"})
    args = parse_args(["--hf-checkpoint", tiny_pipeline_dir, "--prompt-data", data, "--allow-repeated-prompts"])
    with pytest.raises(InputFileError) as err:
        check_input_files(args)
    assert str(err.value) == (
        f"{data}:2: field 'image' names a source image, and the sd3 family generates from text only (--prompt-data): "
        f"use a family that takes source images ({SOURCE_FAMILIES}) or drop the field"
    )
    held_out = prompt_file(tmp_path, {"prompt": "a", "images": ["cat.png"]})
    args = parse_args(["--hf-checkpoint", tiny_pipeline_dir, "--eval-prompt-data", held_out, "--eval-interval", "5"])
    with pytest.raises(InputFileError, match=r"prompts\.jsonl:1: field 'images' names .*\(--eval-prompt-data\)"):
        check_input_files(args)


def test_sft_reads_image_as_its_target_on_a_text_family(tmp_path, tiny_pipeline_dir):
    Image.new("RGB", (8, 8)).save(tmp_path / "cat.png")
    data = prompt_file(tmp_path, {"prompt": "a cat", "image": "cat.png"}, {"prompt": "a dog", "image": "cat.png"})
    args = ["--hf-checkpoint", tiny_pipeline_dir, "--prompt-data", data, "--loss-type", "sft_loss"]
    check_input_files(parse_args([*args, "--rollout-batch-size", "2"]))


def test_a_field_nothing_reads_is_a_warning_naming_it(tmp_path, tiny_pipeline_dir, caplog):
    data = prompt_file(tmp_path, {"prompt": "a", "seed": 3}, {"text": "b", "prompt": "c"})
    args = parse_args(["--hf-checkpoint", tiny_pipeline_dir, "--prompt-data", data, "--allow-repeated-prompts"])
    with caplog.at_level(logging.WARNING, logger="miles.rollout.input_files"):
        check_input_files(args)
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "miles.rollout.input_files"]
    assert warning == (
        f"--prompt-data {data}: no part of this run reads the field(s) 'seed' (line 1), 'text' (line 2); it reads "
        "'metadata', 'prompt' (--input-key, --metadata-key)"
    )
