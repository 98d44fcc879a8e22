"""The simulated ranks together (miles/plan/run.py): the same collectives, a planted rank-dependent one caught, every shard group's first rank of a 2-D mesh."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from miles.arguments.parser import parse_args
from miles.plan.command import plan_settings
from miles.plan.process import ProcessPlan
from miles.plan.report import build_report
from miles.plan.run import CollectiveMismatch, check_collectives, simulate, window_flops
from miles.plan.simulate import PlannedTrainer
from tests.fast.plan.plan_cases import SMALL, plan_args


def test_ranks_issue_the_same_collectives_and_rank_0_gathers_for_the_engines(dp2):
    args, simulation = dp2
    first, last = simulation.roles["actor"]
    assert (first.rank, last.rank) == (0, 1)
    check_collectives(simulation)
    assert [c.op for c in first.collectives if c.phase == "train"]
    assert first.export_bytes > 0 and last.export_bytes == 0
    # a CUDA plan: rank 0 holds two bucket buffers of the weight sync for the whole run (the tiny model fits one
    # bucket: a buffer of its own size, tensors aligned), an engine apart one
    assert first.sync_buffer_bytes == pytest.approx(2 * first.export_bytes, rel=0.01) and last.sync_buffer_bytes == 0
    assert first.peaks["train"] >= first.sync_buffer_bytes + first.params_bytes
    report = build_report(args, simulation, plan_settings(args))
    assert report["roles"]["engine"]["sync_buffer_bytes"] == first.sync_buffer_bytes // 2


def test_planted_rank_dependent_collective_is_caught(monkeypatch):
    """A rank that issues one more all-reduce than rank 0 (the hang class): the plan fails naming both ranks."""
    original = PlannedTrainer._check_same_schedule_on_all_ranks

    def uneven(self, schedule):
        original(self, schedule)
        if self.rank != 0:
            dist.all_reduce(torch.zeros(3))

    monkeypatch.setattr(PlannedTrainer, "_check_same_schedule_on_all_ranks", uneven)
    args = plan_args("--dp-size", "2")
    with pytest.raises(CollectiveMismatch, match=r"actor rank 0 and rank 1 diverge .*allreduce"):
        check_collectives(simulate(args))


def test_hybrid_sharding_simulates_a_rank_of_each_shard_group(tmp_path):
    """--dp-size 4 --fsdp-shard-size 2 (a 2-D mesh), as a user runs it (a fresh process: torch keeps the device meshes a
    process met, so one that simulated other ranks before, like this test session, would hand rank 0's mesh groups to
    a later rank; the planner forks every other rank before rank 0 runs): rank 0, the last rank and the second
    group's first rank issue the same collectives and the plan is written (it failed before: 'Could not resolve the
    process group registered under the name 3')."""
    sizes = ["--micro-batch-size", "4", "--gradient-checkpointing", "off", "--rollout-micro-batch-size", "2"]
    flags = ["--plan", *SMALL, "--dp-size", "4", "--fsdp-shard-size", "2", *sizes, "--output-dir", str(tmp_path)]
    root = Path(__file__).resolve().parents[3]
    done = subprocess.run([sys.executable, str(root / "train_diffusion.py"), *flags], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "plan.json").read_text())
    assert report["roles"]["actor"]["simulated_ranks"] == [0, 3, 2] and report["world_size"] == 5


def test_window_flops_count_the_old_log_prob_recompute_of_later_windows():
    """policy_loss recomputes old log-probs of windows 1.. before training (one forward each, no gradients): with
    4 windows a window carries 3/4 of one; without the flag, or with one window, nothing is added."""
    plan = ProcessPlan("actor", 0, {}, passes={"grad": 1, "no_grad": 1})
    flags = ["--loss-type", "policy_loss", "--rollout-batch-size", "8", "--n-samples-per-prompt", "2"]
    train = (3 + 1) * 10.0 * 4  # a grad forward with its backward, a frozen forward; 10 FLOPs a pair, 4 pairs
    one = parse_args([*flags, "--num-steps-per-rollout", "1", "--diffusion-recompute-old-log-prob"])
    four = parse_args([*flags, "--num-steps-per-rollout", "4", "--diffusion-recompute-old-log-prob"])
    assert window_flops(one, 10.0, plan, 4) == train
    assert window_flops(four, 10.0, plan, 4) == pytest.approx(train + (1 + 1) * 10.0 * 4 * 3 / 4)


def test_a_window_cut_or_stretched_from_the_engine_keeps_simulated_media_a_broadcast():
    """The simulated engine's frames are one broadcast zero (`Media.pixels_uint8`); the window keeps them so (indexing
    would write out every frame) and takes its other fields, and real media, as `select_rows` does."""
    import numpy as np

    from miles.plan.run import _rows_for_window
    from tests.fast.rollout.test_engine_api import result

    engine = result(3)
    frames = (3, 5, 4, 4, 3)
    simulated = dataclasses.replace(engine, images=np.broadcast_to(np.zeros((), dtype=np.uint8), frames))
    for count in (2, 3, 7):  # cut, as is, stretched
        window, samples = _rows_for_window(simulated, ["a", "b", "c"], count)
        expected, expected_samples = _rows_for_window(engine, ["a", "b", "c"], count)  # real media: indexed
        assert samples == expected_samples == [["a", "b", "c"][i % 3] for i in range(count)]
        assert window.images.shape == (count, *frames[1:]) and not any(window.images.strides)
        assert expected.images.shape == (count, 4, 4, 3) and expected.images.strides[0] > 0
        assert torch.equal(window.final_latents, expected.final_latents) and window.batch_size == count


@pytest.mark.parametrize("loss_type", ["policy_loss", "refl"])
def test_a_loss_type_with_a_first_window_guard_or_a_reward_in_the_trainer_plans(loss_type):
    """policy_loss's first-window guard read the simulated window's (fake, zero) ratio and failed the plan; refl's
    reward read the prompt metadata of a fake JSON column (no bytes) and the shipped reward net's weights loaded
    fake. The guard is off under the simulation, the column's rows stand for the first --prompt-data record's."""
    from miles.plan.run import metadata_stand_in, simulate
    from tests.fast.plan.plan_cases import plan_args

    args = plan_args("--loss-type", loss_type, "--dp-size", "1")
    out = simulate(args)
    assert out.roles["actor"][0].peaks["train"] > 0
    stand_in = metadata_stand_in(args)
    assert (
        stand_in == {}
        if loss_type == "policy_loss"
        else {"color", "shape", "count", "position", "prompt"} <= set(stand_in)
    )


@pytest.mark.parametrize(
    "folder,prompts",
    [
        ("builtin:tiny-flux2-klein", "builtin:shapes-edit"),
        ("builtin:tiny-z-image", "builtin:shapes"),
        ("builtin:tiny-qwen-image-edit", "builtin:shapes-edit"),
    ],
)
def test_a_family_whose_conditioning_is_read_by_value_plans(folder, prompts):
    """FLUX.2 grouped its rows by their reference tokens' positions (`.numpy()` of fake ids), Z-Image cut each
    prompt's padding with its mask (a fake mask: no values) and Qwen-Image-Edit's vision tower sized its tokens from
    its patch grids' values: each failed every plan, and so a CUDA run's start-up. Under the simulation FLUX.2's rows
    group by count, Z-Image keeps every token (the longest prompt's cost), Qwen-Image-Edit encodes by shape."""
    from miles.plan.run import simulate
    from tests.fast.plan.plan_cases import plan_args

    out = simulate(plan_args("--hf-checkpoint", folder, "--prompt-data", prompts, "--dp-size", "1"))
    assert out.engine is not None and out.roles["actor"][0].peaks["train"] > 0


def test_fsdp_cpu_offload_plans_with_its_shards_on_the_host():
    """FSDP2 pins each host shard of --fsdp-cpu-offload (`pin_memory`), which fake tensors did not implement: every
    such plan failed, and so did the plans whose suggestions tried the flag (FLUX.1-dev LoRA on one GPU did)."""
    from miles.models.base import get_train_pipeline_config
    from miles.plan.report import role_entry
    from miles.plan.run import simulate
    from tests.fast.plan.plan_cases import plan_args

    args = plan_args("--fsdp-cpu-offload", "--dp-size", "1")
    plan = simulate(args).roles["actor"][0]
    entry = role_entry(plan, offload=True)
    # counted independently: the transformer built for real, its fp32 master weights whole at dp 1
    real = get_train_pipeline_config(args.hf_checkpoint).load_transformer(args.hf_checkpoint)
    weights = sum(p.numel() * 4 for p in real.parameters())
    assert plan.params_bytes == weights and entry["host_offload_bytes"] >= 3 * weights  # + grads and AdamW's moments
    assert entry["peak_bytes"] <= plan.peaks["train"] - entry["host_offload_bytes"]  # the host's is not the GPU's
