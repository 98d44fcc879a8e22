"""The worked example of a loss type added from outside miles (examples/advantage_weighted_fm.py)."""

import json
from pathlib import Path

import pytest
import torch

from miles.utils.arguments import parse_args
from miles.utils.misc import load_module

EXAMPLE = str(Path(__file__).parents[2] / "examples" / "advantage_weighted_fm.py")
BASE = ["--hf-checkpoint", "builtin:tiny-shapes", "--prompt-data", "builtin:shapes"]


def test_the_example_registers_both_sides_of_its_loss_type():
    from miles.algorithms import get_algorithm
    from miles.backends.fsdp_utils.loss_hub import LOSS_HOOKS, check_loss_hooks
    from miles.rollout.rollout_hub import RolloutSpec, get_rollout_spec

    load_module(EXAMPLE)
    check_loss_hooks(LOSS_HOOKS[("awfm", "actor")])
    assert get_algorithm("awfm").scores_rewards  # GRPO advantages weight its pairs
    assert isinstance(get_rollout_spec("awfm"), RolloutSpec)


def test_the_example_loss_matches_a_hand_computation():
    loss_fn = load_module(EXAMPLE).advantage_weighted_fm_loss
    v, noise, x0 = torch.randn(3, 2, 4), torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    advantage = torch.tensor([2.0, -1.0, 9.0])
    got = loss_fn(v, noise, x0, advantage, 5.0)
    for i, weight in enumerate([2.0 / 5.0, 0.0, 1.0]):
        expected = (
            weight
            * sum(float(v[i].flatten()[k] - noise[i].flatten()[k] + x0[i].flatten()[k]) ** 2 for k in range(8))
            / 8
        )
        assert got[i].item() == pytest.approx(expected, rel=1e-5)


def test_an_unknown_loss_type_names_the_choices_and_the_plugin_flag(capsys):
    with pytest.raises(SystemExit):  # a name no module declared (the example's awfm may be registered by now)
        parse_args([*BASE, "--loss-type", "awfm_undeclared"])
    err = capsys.readouterr().err
    assert "awfm_undeclared" in err and "--algorithm-path" in err and "policy_loss" in err


def test_a_plugin_that_fails_to_import_names_the_flag(tmp_path, capsys):
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(SystemExit):
        parse_args([*BASE, "--loss-type", "x", "--algorithm-path", str(broken)])
    err = capsys.readouterr().err
    assert "--algorithm-path" in err and str(broken) in err and "boom" in err


DANCE = str(Path(__file__).parents[2] / "examples" / "dance_grpo_steps.py") + ":random_steps"


def test_the_dance_grpo_strategy_trains_a_seeded_random_60_percent_of_the_steps():
    from miles.rollout.step_strategy_hub import select_trained_steps

    args = parse_args(
        [
            *BASE,
            "--loss-type",
            "policy_loss",
            "--diffusion-sde-type",
            "dance",
            "--diffusion-num-steps",
            "16",
            "--diffusion-step-strategy-path",
            DANCE,
        ]
    )
    draws = [select_trained_steps(args, rollout_id) for rollout_id in range(20)]
    for steps in draws:  # validated by the strategy hub: sorted, unique, never the last step
        assert len(steps) == 9 and steps == sorted(set(steps)) and 0 <= steps[0] and steps[-1] <= 14
    assert draws[0] == select_trained_steps(args, 0)
    assert len({tuple(s) for s in draws}) == 20  # a fresh subset each rollout, not a window
    assert any(steps != list(range(steps[0], steps[0] + 9)) for steps in draws)
    counts = [sum(i in steps for steps in draws) for i in range(15)]
    assert min(counts) > 0  # over 20 rollouts every trainable step is drawn


TRACE = str(Path(__file__).parents[2] / "examples" / "microbatch_trace.py")


def trace_pairs(n: int) -> dict:
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(n, 2, 4, 4, generator=g)
    return {
        "latents": latents,
        "next_latents": latents + 0.1 * torch.randn(n, 2, 4, 4, generator=g),
        "sigma": torch.linspace(1.0, 0.5, n),
        "sigma_next": torch.linspace(0.9, 0.4, n),
        "sigma_max": torch.full((n,), 1.0),
        "old_log_prob": torch.zeros(n),
        "rollout_log_prob": torch.zeros(n),
        "advantage": torch.linspace(-1.0, 1.0, n),
        "pair_index": torch.arange(10, 10 + n),
        "cond/prompt_embeds": torch.randn(n, 3, 5, generator=g),
    }


def test_the_microbatch_trace_example_pairs_both_passes_of_a_microbatch_by_its_id(tmp_path):
    """The trunk's two loops, driven in process through the trunk's own prepare call (6 pairs, 3 windows, micro-batch
    size 1): the trace holds the seed's numbering, and each recompute record meets its training record under one id."""
    from types import MappingProxyType

    from miles.backends.fsdp_utils.loss_hub import LOSS_HOOKS, check_loss_hooks
    from miles.backends.fsdp_utils.loss_hub.types import DiffusionLossContext, WindowMetrics
    from miles.backends.fsdp_utils.microbatch import build_microbatch_schedule
    from miles.backends.fsdp_utils.prefetch import MicrobatchPrefetcher
    from miles.rollout.rollout_hub import RolloutSpec, get_rollout_spec

    flags = ["--algorithm-path", TRACE, "--loss-type", "traced_grpo", "--diffusion-recompute-old-log-prob"]
    args = parse_args([*BASE, *flags, "--diffusion-guidance-scale", "1", "--output-dir", str(tmp_path)])
    hooks = LOSS_HOOKS[("traced_grpo", "actor")]
    check_loss_hooks(hooks, log_prob_ratio=True)
    assert isinstance(get_rollout_spec("traced_grpo"), RolloutSpec)
    ctx = DiffusionLossContext(args, "actor", 7, 1, 2, torch.device("cpu"), torch.float32, None, MappingProxyType({}))
    pairs, outputs = trace_pairs(6), []
    schedule = build_microbatch_schedule(6, 3, 1)

    def run(window_steps, write):
        for step in window_steps:
            for _, batch, prepared in MicrobatchPrefetcher(False, ctx.device).prepared(
                hooks.prepare, ctx, pairs, schedule[step], step
            ):
                keywords = {
                    "new_pred": 0.05 * prepared.latents,  # one fixed "network": the policy does not move here
                    "frozen_preds": MappingProxyType({}),
                    "metrics": WindowMetrics(),
                    "optim_step_idx": step,
                    "train_output_inputs": outputs,
                    "write_old_log_prob": write,
                    "old_log_prob_from_new": not write and step == 0,
                }
                hooks.formula(ctx, batch, prepared, **keywords)

    run([1, 2], write=True)  # the recompute loop: windows 1..
    run([0, 1, 2], write=False)  # the training loop
    hooks.train_output(ctx, pairs, outputs)
    lines = (tmp_path / "microbatch_trace" / "rank1.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    seen = [(r["pass"], r["microbatch_id"], r["optim_step_idx"]) for r in records]
    recompute = [("recompute", 2, 1), ("recompute", 3, 1), ("recompute", 4, 2), ("recompute", 5, 2)]
    assert seen == recompute + [("train", mb, mb // 2) for mb in range(6)]
    assert all(r["rollout_id"] == 7 for r in records)
    stored = {r["microbatch_id"]: r for r in records if r["pass"] == "recompute"}
    for r in records[len(recompute) :]:
        assert r["pairs"] == [10 + r["microbatch_id"]]  # micro-batch size 1: pair row i is micro-batch i
        if r["microbatch_id"] in stored:  # windows 1..: what its recompute pass stored, found by the id
            assert stored[r["microbatch_id"]]["pairs"] == r["pairs"]
            assert r["old_log_prob_mean"] == stored[r["microbatch_id"]]["log_prob_mean"]
