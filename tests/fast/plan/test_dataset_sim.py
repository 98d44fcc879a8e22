"""The trainer's window of a run on dataset pairs (miles/plan/dataset_sim.py): the first records encoded on fake
tensors as the rollout manager encodes them, and the plan of such a run (the trainer alone)."""

from __future__ import annotations

import json

import pytest


def _preference_file(folder) -> list[str]:
    from PIL import Image

    Image.new("RGB", (16, 16), (255, 0, 0)).save(folder / "a.png")
    Image.new("RGB", (16, 16), (0, 0, 255)).save(folder / "b.png")
    rows = [{"prompt": f"p{i}", "image_0": "a.png", "image_1": "b.png", "preferred": 0} for i in range(16)]
    (folder / "pref.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return ["--loss-type", "dpo", "--train-only", "--dpo-preference-data", str(folder / "pref.jsonl")]


@pytest.mark.parametrize(
    "case",
    ["sft", "dpo"],
)
def test_a_run_on_dataset_pairs_plans_its_trainer_without_engines_or_a_weight_sync(case, tmp_path):
    """--train-only runs train on pairs encoded from their records at start-up (a DatasetSpec), which the planner
    refused: a CUDA sft_loss run stopped at its start-up check. The plan encodes the first records on fake tensors as
    the rollout manager does and simulates the trainer alone: no engine, no weight sync, a pair's forward counted."""
    from miles.plan.run import simulate
    from tests.fast.plan.plan_cases import plan_args

    flags = ["--loss-type", "sft_loss", "--train-only"] if case == "sft" else _preference_file(tmp_path)
    out = simulate(plan_args(*flags, "--dp-size", "1"))
    x0 = "x0" if case == "sft" else "x0_w"
    assert out.engine is None and x0 in out.window and any(key.startswith("cond/") for key in out.window)
    plan = out.roles["actor"][0]
    assert plan.peaks["train"] > 0 and plan.export_bytes == 0 and "weight sync" not in plan.peaks
    assert out.forward_flops_per_sample > 0 and out.train_flops["actor"] > 0
