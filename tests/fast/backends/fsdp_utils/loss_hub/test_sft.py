"""The sft_loss hooks: its entry passes the contract; the prepare noises each pair's x₀ at a timestep and with noise
drawn by its row (the same wherever the pair lands), and the formula is the flow-matching loss against ε − x₀."""

import argparse
from types import SimpleNamespace

import pytest
import torch

from miles.backends.fsdp_utils.loss_hub import get_loss_hooks
from miles.backends.fsdp_utils.loss_hub.sft import prepare_sft_batch, sft_formula
from miles.backends.fsdp_utils.loss_hub.types import DiffusionLossContext, WindowMetrics
from tests.fast.backends.fsdp_utils.loss_hub.test_loss_hub import make_args


def test_builtin_sft_hooks_pass_the_check():
    hooks = get_loss_hooks(make_args(loss_type="sft_loss"), "actor")
    assert hooks.prepare.__name__ == "prepare_sft_batch"


def ctx(weighting="none"):
    args = argparse.Namespace(
        seed=3,
        sft_timestep_sampling="logit_normal",
        sft_logit_mean=0.0,
        sft_logit_std=1.0,
        sft_mode_scale=1.29,
        sft_loss_weighting=weighting,
    )
    family = SimpleNamespace(scheduler_shift=3.0)
    return DiffusionLossContext(args, "actor", 2, 0, 1, torch.device("cpu"), torch.float32, family, {})


def pairs(rows):
    x0 = torch.stack([torch.full((2, 4), float(r)) for r in rows])
    return {"x0": x0, "pair_index": torch.tensor(rows), "cond/prompt_embeds": torch.ones(len(rows), 3)}


def test_prepare_noises_each_pair_by_its_row_wherever_it_lands():
    mixed = prepare_sft_batch(ctx(), pairs([4, 7, 1]), microbatch_id=0, optim_step_idx=0)
    alone = prepare_sft_batch(ctx(), pairs([7]), microbatch_id=5, optim_step_idx=0)
    assert torch.equal(alone.sigmas[0], mixed.sigmas[1]) and torch.equal(
        alone.extras["noise"][0], mixed.extras["noise"][1]
    )
    assert ((mixed.sigmas > 0) & (mixed.sigmas <= 1)).all() and len(set(mixed.sigmas.tolist())) == 3
    s = mixed.sigmas[:, None, None]
    torch.testing.assert_close(mixed.latents, (1 - s) * mixed.extras["x0"] + s * mixed.extras["noise"])
    assert torch.equal(mixed.embeds["prompt_embeds"], torch.ones(3, 3))
    again = prepare_sft_batch(ctx(), pairs([4, 7, 1]), microbatch_id=0, optim_step_idx=1)
    assert not torch.equal(again.sigmas, mixed.sigmas)  # another window: fresh draws


def test_the_loss_is_zero_at_the_flow_target_and_the_mean_squared_gap_elsewhere():
    prepared = prepare_sft_batch(ctx(), pairs([0, 1]), microbatch_id=0, optim_step_idx=0)
    target = prepared.extras["noise"] - prepared.extras["x0"]
    metrics = WindowMetrics()
    assert sft_formula(ctx(), {}, prepared, new_pred=target, metrics=metrics).item() == 0.0
    assert metrics.means()["train/sigma_mean"] == pytest.approx(prepared.sigmas.mean().item())
    loss = sft_formula(ctx(), {}, prepared, new_pred=target + 0.5, metrics=WindowMetrics())
    assert loss.item() == pytest.approx(2 * 0.25)  # two pairs, each mean((0.5)²)
