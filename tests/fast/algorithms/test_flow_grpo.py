"""The policy_loss (Flow-GRPO) declaration's rules and what it declares, on the values the parser hands them."""

from __future__ import annotations

from types import SimpleNamespace

from miles.algorithms.flow_grpo import ALGORITHM, validate


def args(**values):
    return SimpleNamespace(**{"diffusion_kl_beta": 0.0, "ref_mode": "none", "diffusion_sde_type": "sde", **values})


def test_the_rules_ask_for_stochastic_steps_and_a_reference_for_the_kl():
    assert validate(args()) == [] and validate(args(diffusion_sde_type="cps")) == []
    assert validate(args(diffusion_sde_type="ode")) == [
        "--loss-type policy_loss needs stochastic steps: --diffusion-sde-type sde or cps"
    ]
    assert validate(args(diffusion_kl_beta=0.04, diffusion_sde_type="ode")) == [
        "--diffusion-kl-beta > 0 needs a reference: --ref-mode lora_base or ema",
        "--loss-type policy_loss needs stochastic steps: --diffusion-sde-type sde or cps",
    ]
    assert validate(args(diffusion_kl_beta=0.04, ref_mode="lora_base")) == []


def test_a_ratio_loss_guarded_in_its_first_window_and_known_by_its_metrics():
    assert ALGORITHM.log_prob_ratio and ALGORITHM.first_window_metrics.ratio == "train/ratio_mean"
    assert ALGORITHM.samples_sde and ALGORITHM.scores_rewards and ALGORITHM.reads == ("ref_mode",)
    assert ALGORITHM.flag_ranges["diffusion_clip_range"].describe() == "> 0"
    assert set(ALGORITHM.identifying_metrics) == {"train/ratio_mean", "train/clipfrac"}
