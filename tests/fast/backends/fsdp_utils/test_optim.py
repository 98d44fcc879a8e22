import math

import pytest
import torch

from miles.arguments.parser import default_args, parse_args
from miles.backends.fsdp_utils.optim import (
    OptimizerFlags,
    build_lr_scheduler,
    build_optimizer,
    lr_multiplier,
    scale_learning_rate,
)


def test_warmup_is_linear_then_constant():
    values = [lr_multiplier(s, warmup_steps=4, decay_steps=10, decay_style="constant", min_ratio=0.0) for s in range(6)]
    assert values == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("step", [2, 5, 7, 12])
def test_cosine_and_linear_decay_match_their_formulas(step):
    progress = min((step - 2) / 8, 1.0)
    cos = lr_multiplier(step, warmup_steps=2, decay_steps=10, decay_style="cosine", min_ratio=0.1)
    lin = lr_multiplier(step, warmup_steps=2, decay_steps=10, decay_style="linear", min_ratio=0.1)
    assert cos == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
    assert lin == pytest.approx(0.1 + 0.9 * (1 - progress))


def test_the_optimizer_record_holds_the_flags_that_build_adamw_and_its_schedule():
    defaults = OptimizerFlags.from_args(default_args())
    assert (defaults.adam_beta1, defaults.adam_beta2, defaults.adam_eps, defaults.weight_decay) == (
        0.9,
        0.999,
        1e-8,
        0.0,
    )
    assert (defaults.lr_warmup_steps, defaults.lr_decay_steps, defaults.lr_decay_style, defaults.min_lr) == (
        0, None, "constant", 0.0
    )  # fmt: skip
    args = parse_args(
        [
            "--hf-checkpoint", "unused", "--adam-beta1", "0.8", "--adam-beta2", "0.95", "--adam-eps", "1e-6",
            "--weight-decay", "0.01", "--lr", "1e-3", "--lr-warmup-steps", "2", "--lr-decay-steps", "10",
            "--lr-decay-style", "linear", "--min-lr", "1e-4",
        ]
    )  # fmt: skip
    flags = OptimizerFlags.from_args(args)
    optimizer = build_optimizer([torch.nn.Parameter(torch.ones(2))], flags, lr=1e-3)
    group = optimizer.param_groups[0]
    assert (group["betas"], group["eps"], group["weight_decay"]) == ((0.8, 0.95), 1e-6, 0.01)
    scheduler = build_lr_scheduler(optimizer, flags, lr=1e-3, total_steps=100)
    factors = [scheduler.lr_lambdas[0](step) for step in (0, 1, 2, 6, 10, 50)]
    assert factors == pytest.approx([0.5, 1.0, 1.0, 0.1 + 0.9 * 0.5, 0.1, 0.1])  # warm-up 2, linear to 0.1 at 10


def test_a_rollbacks_lower_learning_rate_scales_the_schedule_from_its_step_on():
    """The rates after `scale_learning_rate(0.5)` are half those of the same schedule unscaled, step for step, and
    a state dict saved afterwards keeps them (a checkpoint after a rollback)."""
    flags = OptimizerFlags.from_args(
        default_args(lr_warmup_steps=2, lr_decay_steps=8, lr_decay_style="cosine", min_lr=1e-4)
    )
    runs = []
    for factor in (1.0, 0.5):
        parameter = torch.nn.Parameter(torch.zeros(3))
        optimizer = build_optimizer([parameter], flags, 1e-3)
        scheduler = build_lr_scheduler(optimizer, flags, 1e-3, total_steps=8)
        rates = []
        for step in range(6):
            if step == 3:
                scale_learning_rate(optimizer, scheduler, factor)
            rates.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        runs.append((rates, scheduler.state_dict()))
    (plain, _), (scaled, state) = runs
    assert scaled[:3] == plain[:3]
    assert scaled[3:] == pytest.approx([0.5 * rate for rate in plain[3:]], rel=1e-12)
    assert state["base_lrs"] == [0.5e-3]
