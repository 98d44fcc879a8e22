"""Input files fail before any actor starts, naming FILE:LINE."""

from __future__ import annotations

import pytest

import train_diffusion
from miles.rollout.data_source import PromptDataError
from miles.rollout.input_files import InputFileError, check_model_index
from miles.utils.arguments import parse_args


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
