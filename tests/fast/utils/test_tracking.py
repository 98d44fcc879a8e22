"""metrics.jsonl and the trackers: every key on its axis, the image grids, the extras named when missing."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import numpy as np
import pytest

from miles.rollout.image_grid import save_image_grid
from miles.utils.tracking import (
    EVAL_AXIS,
    MetricsWriter,
    TensorBoardSink,
    Tracking,
    WandbSink,
    first_compile_seconds,
    open_tracking,
    read_metrics,
    scalar_points,
    wandb_mode,
)

sys.path.insert(0, os.path.dirname(__file__))
from tracker_readers import read_tensorboard, read_wandb_offline  # noqa: E402

# what a 2-rollout dmd2 run with evals logs, in the driver's order (baseline eval first)
RECORDS = [
    {"rollout_id": 0, "step": 0, "eval/shapes_accuracy": 0.25, "perf/eval_s": 1.5, EVAL_AXIS: 0},
    {"role": "critic", "rollout_id": 0, "step": 1, "train/loss": 0.5, "train/grad_norm": 2.0},
    {"role": "actor", "rollout_id": 0, "step": 1, "train/loss": 1.5, "train/lr": 1e-4},
    {"rollout_id": 0, "step": 1, "rollout/reward_mean": 0.75, "perf/train_s": 3.0},
    {"role": "critic", "rollout_id": 1, "step": 2, "train/loss": 0.25, "train/grad_norm": 1.0},
    {"role": "actor", "rollout_id": 1, "step": 2, "train/loss": 1.25, "train/lr": 1e-4},
    {"rollout_id": 1, "step": 2, "rollout/reward_mean": 0.5, "perf/train_s": 2.0, "eval/shapes_accuracy": 0.5,
     "perf/eval_s": 1.0, EVAL_AXIS: 2},
]  # fmt: skip
# the same, as (tag, x) -> value, written out by hand
EXPECTED = {
    ("eval/shapes_accuracy", 0): 0.25,
    ("perf/eval_s", 0): 1.5,
    ("eval/rollouts_trained", 0): 0,
    ("critic/train/loss", 1): 0.5,
    ("critic/train/grad_norm", 1): 2.0,
    ("train/loss", 1): 1.5,
    ("train/lr", 1): 1e-4,
    ("rollout/reward_mean", 0): 0.75,
    ("perf/train_s", 0): 3.0,
    ("critic/train/loss", 2): 0.25,
    ("critic/train/grad_norm", 2): 1.0,
    ("train/loss", 2): 1.25,
    ("train/lr", 2): 1e-4,
    ("rollout/reward_mean", 1): 0.5,
    ("perf/train_s", 1): 2.0,
    ("eval/shapes_accuracy", 2): 0.5,
    ("perf/eval_s", 2): 1.0,
    ("eval/rollouts_trained", 2): 2,
}


def test_non_finite_floats_are_written_as_strings_and_read_back_as_floats(tmp_path):
    writer = MetricsWriter(str(tmp_path))
    writer.log({"a": math.nan, "b": math.inf, "c": -math.inf, "d": 1.5, "e": "nan-free text"})
    writer.close()
    raw = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert (raw["a"], raw["b"], raw["c"]) == ("nan", "inf", "-inf")
    (back,) = read_metrics(tmp_path / "metrics.jsonl")
    assert math.isnan(back["a"]) and back["b"] == math.inf and back["c"] == -math.inf
    assert (back["d"], back["e"]) == (1.5, "nan-free text")


def test_a_resumed_run_drops_a_last_line_cut_mid_record_and_keeps_the_rest(tmp_path, caplog):
    """The run before was killed while writing rollout 2's record: a resumed run (its tracking opened on the same
    --output-dir) drops that partial line with a warning naming the file and line, keeps rollouts 0 and 1, and its
    own records follow on whole lines."""
    path = tmp_path / "metrics.jsonl"
    whole = [json.dumps({"rollout_id": k, "rollout/reward_mean": k / 4}, sort_keys=True) for k in range(2)]
    path.write_text("\n".join(whole) + '\n{"rollout/reward_mean": 0.5, "rollo')
    assert [r["rollout_id"] for r in read_metrics(path)] == [0, 1]  # a reader skips the cut line too
    with caplog.at_level("WARNING", logger="miles.utils.tracking"):
        tracking = open_tracking(argparse.Namespace(use_tensorboard=False, use_wandb=False, output_dir=str(tmp_path)))
    assert f"{path}:3: the last line was cut mid-record" in caplog.text
    tracking.log({"rollout_id": 2, "rollout/reward_mean": 0.75})
    tracking.close()
    assert path.read_text().splitlines() == [*whole, '{"rollout/reward_mean": 0.75, "rollout_id": 2}']
    # a last record whole but for its newline is kept
    path.write_text(whole[0])
    MetricsWriter(str(tmp_path)).close()
    assert path.read_text() == whole[0] + "\n"


def test_each_record_is_one_write_of_a_whole_line(tmp_path, monkeypatch):
    """A record larger than any I/O buffer still reaches the file in one write: a kill leaves whole lines."""
    import miles.utils.tracking as tracking

    writes = []
    real_write = os.write
    monkeypatch.setattr(tracking.os, "write", lambda fd, data: writes.append(bytes(data)) or real_write(fd, data))
    writer = MetricsWriter(str(tmp_path))
    record = {f"metric/{k:05d}": float(k) for k in range(2000)}  # ~40 KB
    writer.log(record)
    writer.log({"rollout_id": 1})
    writer.close()
    assert [w.endswith(b"\n") and w.count(b"\n") == 1 for w in writes] == [True, True] and len(writes[0]) > 32768
    assert read_metrics(tmp_path / "metrics.jsonl") == [record, {"rollout_id": 1}]


def test_each_number_goes_on_its_axis():
    points = [point for record in RECORDS for point in scalar_points(record)]
    assert {(tag, x): value for tag, _, x, value in points} == EXPECTED
    assert len(points) == len(EXPECTED)  # no point twice
    axes = {tag: axis for tag, axis, _, _ in points}
    assert axes["critic/train/loss"] == "critic/step" and axes["train/loss"] == "actor/step"
    assert axes["eval/shapes_accuracy"] == EVAL_AXIS and axes["rollout/reward_mean"] == "rollout_id"


def write_grids(output_dir, rollout_id: int, evaluated: int | None) -> dict[str, np.ndarray]:
    """A rollout grid and maybe an eval grid, as the rollout manager and evaluator name them; returns the pixels."""
    rng = np.random.default_rng(rollout_id)
    grids = {}
    names = [f"rollout_{rollout_id:07d}.png"] + ([f"eval_{evaluated:07d}.png"] if evaluated is not None else [])
    for name in names:
        path = save_image_grid(rng.integers(0, 256, (4, 8, 8, 3), dtype=np.uint8), str(output_dir / "images" / name))
        from PIL import Image

        grids[name] = np.asarray(Image.open(path))
    return grids


def log_run(tracking: Tracking, output_dir) -> dict[str, np.ndarray]:
    """RECORDS through `tracking`, with the grids a run writes before its rollout and eval records."""
    grids = {}
    (output_dir / "images").mkdir(parents=True, exist_ok=True)
    grids.update(write_grids(output_dir, 0, None))
    for record in RECORDS:
        if record.get("role") is None and "rollout/reward_mean" in record and record["rollout_id"] == 1:
            grids.update(write_grids(output_dir, 1, 2))
        tracking.log(record)
    tracking.close()
    return grids


def test_tensorboard_holds_every_number_and_every_grid(tmp_path):
    logdir = str(tmp_path / "tensorboard")
    grids = log_run(Tracking(str(tmp_path), [TensorBoardSink(logdir)]), tmp_path)
    scalars, images = read_tensorboard(logdir)
    got = {(tag, step): value for tag, steps in scalars.items() for step, value in steps.items()}
    assert got.keys() == EXPECTED.keys()
    for key, value in EXPECTED.items():
        assert got[key] == pytest.approx(value, rel=1e-6), key
    assert sorted(images["rollout/images"]) == [0, 1] and sorted(images["eval/images"]) == [2]
    np.testing.assert_array_equal(images["rollout/images"][1], grids["rollout_0000001.png"])
    np.testing.assert_array_equal(images["eval/images"][2], grids["eval_0000002.png"])
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == len(RECORDS)  # the JSONL is written as before


def wandb_args(tmp_path) -> argparse.Namespace:
    return argparse.Namespace(
        output_dir=str(tmp_path), wandb_project="miles-test", wandb_group="g", wandb_run_name="r", lr=1e-4
    )


def test_offline_wandb_run_holds_every_number_and_every_grid(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    grids = log_run(Tracking(str(tmp_path), [WandbSink(wandb_args(tmp_path))]), tmp_path)
    rows, files = read_wandb_offline(str(tmp_path / "wandb"))
    axis_of = {tag: axis for record in RECORDS for tag, axis, _, _ in scalar_points(record)}
    got = {(tag, row[axis_of[tag]]): value for row in rows for tag, value in row.items() if tag in axis_of}
    assert got == pytest.approx(EXPECTED)
    from PIL import Image

    images = {}
    for row in rows:
        for tag, axis, kind in (("rollout/images", "rollout_id", "rollout"), ("eval/images", EVAL_AXIS, "eval")):
            if tag in row:
                assert row[tag]["_type"] == "image-file"
                images[f"{kind}_{row[axis]:07d}.png"] = np.asarray(Image.open(os.path.join(files, row[tag]["path"])))
    assert images.keys() == grids.keys()
    for name, pixels in grids.items():
        np.testing.assert_array_equal(images[name], pixels)


def test_wandb_logs_offline_without_a_network(monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # the discard port: nothing listens
    assert wandb_mode() == "offline"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode() == "disabled"


@pytest.mark.parametrize(("flag", "module", "extra"), [
    ("use_tensorboard", "torch.utils.tensorboard", "miles[tensorboard]"),
    ("use_wandb", "wandb", "miles[wandb]"),
])  # fmt: skip
def test_a_missing_tracker_library_names_the_flag_and_the_extra(tmp_path, monkeypatch, flag, module, extra):
    monkeypatch.setitem(sys.modules, module, None)  # import fails as if it were not installed
    args = wandb_args(tmp_path)
    args.use_tensorboard, args.use_wandb = flag == "use_tensorboard", flag == "use_wandb"
    with pytest.raises(ImportError) as err:
        open_tracking(args)
    assert extra in str(err.value) and "--" + flag.replace("_", "-") in str(err.value)


def test_without_trackers_only_the_jsonl_is_written(tmp_path):
    args = wandb_args(tmp_path)
    args.use_tensorboard = args.use_wandb = False
    tracking = open_tracking(args)
    tracking.log(RECORDS[0])
    tracking.close()
    assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl"]


def test_the_first_rollouts_compiling_is_the_engines_then_the_trainers(caplog):
    record = {"perf/engine_compile_s": 15.0}
    windows = [{"role": "actor", "perf/compile_s": 90.0}, {"role": "actor", "perf/compile_s": 91.0}, {"role": "x"}]
    with caplog.at_level("INFO", logger="miles.driver"):
        assert first_compile_seconds(record, windows) == 106.0
    assert "compiled 106.0s in the first rollout (engines 15.0s, then the trainer 91.0s)" in caplog.text
    assert first_compile_seconds({}, []) == 0.0  # nothing compiled (aot_eager, a cached graph)
