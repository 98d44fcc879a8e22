"""The dmd2 hooks on plain tensors with a fake family: the critic's scoring window (the teacher named with its CFG,
run by the trunk's forward) and train output (x − g against hand-written maths), the critic loss, and the
generator's gradient g/numel at x_θ = x."""

import argparse
from types import MappingProxyType

import pytest
import torch

from miles.arguments.parser import default_args
from miles.backends.fsdp_utils.loss_hub import LOSS_HOOKS, check_loss_hooks
from miles.backends.fsdp_utils.loss_hub.dmd2 import (
    ROW,
    critic_formula,
    critic_train_output,
    generator_formula,
    prepare_critic_batch,
    prepare_generator_batch,
    tile_critic_pairs,
)
from miles.backends.fsdp_utils.loss_hub.types import DiffusionLossContext, WindowMetrics
from miles.backends.fsdp_utils.microbatch import build_microbatch_schedule
from miles.backends.fsdp_utils.train_loop import TrainLoop
from miles.utils.json_column import encode_json_column
from miles.utils.types import slice_pairs
from tests.fast.backends.fsdp_utils.loss_hub.reward_pairs import THIS_FILE as REWARD_FILE
from tests.fast.backends.fsdp_utils.loss_hub.reward_pairs import pattern

P, C, H, W, L, D, Q = 4, 2, 4, 4, 5, 6, 7
REAL_SCALE = 3.0


class FakeFamily:
    """v = network(latents, sigmas, pooled); CFG as uncond + w·(cond − uncond) with the negative's pooled vector."""

    scheduler_shift = 3.0

    def predict_velocity(self, network, latents, sigmas, embeds, *, guidance_scale=1.0, negative=None):
        cond = network(latents, sigmas, embeds["pooled_prompt_embeds"])
        if guidance_scale <= 1.0:
            return cond
        uncond = network(latents, sigmas, negative["pooled_prompt_embeds"].expand(latents.shape[0], -1))
        return uncond + guidance_scale * (cond - uncond)


class AffineNetwork(torch.nn.Module):
    def __init__(self, scale: float, bias: float) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(scale))
        self.bias = bias

    def forward(self, latents, sigmas, pooled):
        shift = self.bias * pooled.mean(dim=1).reshape(-1, 1, 1, 1)
        return self.scale * latents + shift + sigmas.reshape(-1, 1, 1, 1)


def make_ctx(windows=2, role="critic", networks=None, **overrides):
    values = dict(
        seed=1234,
        critic_num_steps_per_rollout=windows,
        dmd2_timestep_shift=None,
        dmd2_t_min=0.02,
        dmd2_t_max=0.98,
        dmd2_real_guidance_scale=REAL_SCALE,
        dmd2_reward_weight=0.0,
        dmd2_reward_hinge=None,
    )
    values.update(overrides)
    return DiffusionLossContext(
        args=argparse.Namespace(**values),
        role=role,
        rollout_id=0,
        dp_rank=0,
        dp_size=1,
        device=torch.device("cpu"),
        forward_dtype=torch.float32,
        family=FakeFamily(),
        networks=MappingProxyType(networks or {}),
    )


def make_pairs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "latents": torch.randn(P, C, H, W, generator=g),
        "sigma": torch.full((P,), 0.75),
        "x": torch.randn(P, C, H, W, generator=g),
        "cond/prompt_embeds": torch.randn(P, L, D, generator=g),
        "cond/pooled_prompt_embeds": torch.randn(P, Q, generator=g),
        "negative_cond/prompt_embeds": torch.zeros(P, L, D),
        "negative_cond/pooled_prompt_embeds": torch.randn(1, Q, generator=g).expand(P, -1).clone(),
        "sample_index": torch.arange(P),
        "pair_index": torch.arange(P),
    }


class Trunk(TrainLoop):
    """The trunk's forward (`TrainLoop._forward`) over a critic and a teacher, without FSDP."""

    def __init__(self, ctx, critic, teacher):
        self.model, self.family, self.role = critic, ctx.family, "critic"
        self.networks = MappingProxyType({"policy": critic, "teacher": teacher})


def formula(fn, ctx, batch, prepared, new_pred, optim_step_idx=0, inputs=None, metrics=None, frozen_preds=None):
    return fn(
        ctx,
        batch,
        prepared,
        new_pred=new_pred,
        frozen_preds=MappingProxyType(frozen_preds or {}),
        metrics=metrics if metrics is not None else WindowMetrics(),
        optim_step_idx=optim_step_idx,
        train_output_inputs=inputs if inputs is not None else [],
    )


def run_critic(ctx, pairs, critic, teacher, micro_batch_size=2):
    """The trunk's loops without optimizer steps: train_input, windows of micro-batches (the trunk's forward of the
    critic and of every frozen network the prepare names), then train_output."""
    trunk = Trunk(ctx, critic, teacher)
    tiled = tile_critic_pairs(ctx, pairs)
    schedule = build_microbatch_schedule(
        P * ctx.args.critic_num_steps_per_rollout, ctx.args.critic_num_steps_per_rollout, micro_batch_size
    )
    inputs, prepared_by_window = [], []
    for optim_step_idx, window in enumerate(schedule):
        for mb in window:
            batch = slice_pairs(tiled, mb.start, mb.end)
            prepared = prepare_critic_batch(ctx, batch, microbatch_id=mb.microbatch_id, optim_step_idx=optim_step_idx)
            preds = trunk._forward(prepared)
            formula(
                critic_formula,
                ctx,
                batch,
                prepared,
                preds["new_pred"],
                optim_step_idx,
                inputs,
                None,
                preds["frozen_preds"],
            )
            prepared_by_window.append((optim_step_idx, batch, prepared, preds["new_pred"].detach()))
    return tiled, inputs, prepared_by_window, critic_train_output(ctx, tiled, inputs)


def test_dmd2_hooks_pass_the_signature_check():
    check_loss_hooks(LOSS_HOOKS[("dmd2", "critic")])
    check_loss_hooks(LOSS_HOOKS[("dmd2", "actor")])


def test_critic_pairs_are_tiled_once_per_window_with_their_rows():
    pairs = make_pairs()
    tiled = tile_critic_pairs(make_ctx(windows=3), pairs)
    assert tiled["x"].shape[0] == 3 * P
    assert tiled[ROW].tolist() == list(range(P)) * 3
    assert torch.equal(tiled["x"][2 * P :], pairs["x"])


def test_critic_prepare_noises_x_at_clamped_seeded_timesteps():
    ctx, pairs = make_ctx(), make_pairs()
    first = prepare_critic_batch(ctx, pairs, microbatch_id=1, optim_step_idx=0)
    again = prepare_critic_batch(ctx, pairs, microbatch_id=5, optim_step_idx=0)  # another rank's micro-batch
    other = prepare_critic_batch(ctx, pairs, microbatch_id=1, optim_step_idx=1)  # the pair's copy in a later window
    assert torch.equal(first.latents, again.latents) and not torch.equal(first.latents, other.latents)
    t = first.sigmas
    assert bool(((t >= 0.02) & (t <= 0.98)).all())
    expected = (1 - t.reshape(-1, 1, 1, 1)) * pairs["x"] + t.reshape(-1, 1, 1, 1) * first.extras["noise"]
    torch.testing.assert_close(first.latents, expected)
    assert first.guidance_scale == 1.0 and first.negative is None and first.frozen_networks == ()


def test_critic_prepare_names_the_teacher_with_its_cfg_only_in_the_scoring_window():
    ctx, pairs = make_ctx(windows=3), make_pairs()
    for step in (0, 1):
        assert prepare_critic_batch(ctx, pairs, microbatch_id=step, optim_step_idx=step).frozen_networks == ()
    scoring = prepare_critic_batch(ctx, pairs, microbatch_id=2, optim_step_idx=2)
    assert scoring.frozen_networks == ("teacher",)
    assert scoring.guidance_scale == 1.0 and scoring.negative is None  # the critic's own forward stays CFG-free
    teacher = scoring.guidance_of("teacher")
    assert teacher.scale == REAL_SCALE
    assert torch.equal(teacher.negative["pooled_prompt_embeds"], pairs["negative_cond/pooled_prompt_embeds"])
    plain = prepare_critic_batch(
        make_ctx(windows=3, dmd2_real_guidance_scale=1.0), pairs, microbatch_id=2, optim_step_idx=2
    )
    assert plain.guidance_of("teacher").scale == 1.0 and plain.guidance_of("teacher").negative is None


def test_critic_loss_is_zero_for_a_perfect_prediction():
    ctx, pairs = make_ctx(), make_pairs()
    prepared = prepare_critic_batch(ctx, pairs, microbatch_id=0, optim_step_idx=0)
    perfect = prepared.extras["noise"] - pairs["x"]
    assert formula(critic_formula, ctx, pairs, prepared, perfect).item() == pytest.approx(0.0, abs=1e-10)
    assert formula(critic_formula, ctx, pairs, prepared, perfect + 0.1).item() > 0


def test_critic_appends_scoring_inputs_only_in_its_scoring_window():
    ctx, pairs = make_ctx(windows=3), make_pairs()
    tiled = tile_critic_pairs(ctx, pairs)
    batch = slice_pairs(tiled, 0, 2)
    prepared = prepare_critic_batch(ctx, batch, microbatch_id=0, optim_step_idx=0)
    inputs: list = []
    for step in (0, 1):
        formula(critic_formula, ctx, batch, prepared, torch.zeros(2, C, H, W), step, inputs)
    assert inputs == []
    with pytest.raises(KeyError, match="'teacher' network's prediction"):
        formula(critic_formula, ctx, batch, prepared, torch.zeros(2, C, H, W), 2, inputs)
    frozen = {"teacher": torch.ones(2, C, H, W)}
    formula(critic_formula, ctx, batch, prepared, torch.zeros(2, C, H, W), 2, inputs, None, frozen)
    assert len(inputs) == 1 and inputs[0]["rows"].tolist() == [0, 1]
    t = prepared.sigmas.reshape(-1, 1, 1, 1)
    torch.testing.assert_close(inputs[0]["x_hat_real"], prepared.latents - t)  # x̂₀ = x_t − t·v_real, v_real = 1


def test_train_output_target_is_x_minus_g_computed_independently():
    critic, teacher = AffineNetwork(0.3, 0.5), AffineNetwork(-0.2, 1.5)
    ctx, pairs = make_ctx(windows=2), make_pairs()
    _, inputs, prepared_by_window, output = run_critic(ctx, pairs, critic, teacher)
    assert len(inputs) == 2  # the scoring window's two micro-batches
    target = output["dmd_target"]
    assert target.shape == pairs["x"].shape
    with torch.no_grad():
        for step, batch, prepared, v_fake in prepared_by_window:
            if step != 1:
                continue
            x_t, t4 = prepared.latents, prepared.sigmas.reshape(-1, 1, 1, 1)
            x = batch["x"]
            cond = teacher(x_t, prepared.sigmas, batch["cond/pooled_prompt_embeds"])
            uncond = teacher(x_t, prepared.sigmas, batch["negative_cond/pooled_prompt_embeds"])
            x_real = x_t - t4 * (uncond + REAL_SCALE * (cond - uncond))
            x_fake = x_t - t4 * v_fake
            norm = (x - x_real).abs().mean(dim=(1, 2, 3), keepdim=True)
            expected = x - (x_fake - x_real) / norm
            torch.testing.assert_close(target[batch[ROW]], expected, rtol=1e-5, atol=1e-5)


def test_train_output_rejects_a_scoring_window_that_misses_pairs():
    ctx, pairs = make_ctx(windows=2), make_pairs()
    tiled, inputs, _, _ = run_critic(ctx, pairs, AffineNetwork(0.5, 0.0), AffineNetwork(1.0, 0.0))
    with pytest.raises(RuntimeError, match="cover each"):
        critic_train_output(ctx, tiled, inputs[:1])


def test_generator_gradient_at_x_equals_g_over_numel():
    ctx, pairs = make_ctx(role="actor"), make_pairs()
    g = torch.randn(P, C, H, W, generator=torch.Generator().manual_seed(3))
    pairs["peer/dmd_target"] = pairs["x"] - g
    prepared = prepare_generator_batch(ctx, pairs, microbatch_id=0, optim_step_idx=0)
    sigma = prepared.sigmas.reshape(-1, 1, 1, 1)
    v = ((prepared.latents - pairs["x"]) / sigma).requires_grad_(True)  # x_θ = x_t − σ·v = x
    metrics = WindowMetrics()
    formula(generator_formula, ctx, pairs, prepared, v, metrics=metrics).backward()
    grad_x_theta = -v.grad / sigma  # ∂x_θ/∂v = −σ
    torch.testing.assert_close(grad_x_theta, g / (C * H * W))
    means = metrics.means()
    assert means["train/generator_x0_abs_diff"] < 1e-6
    assert means["train/dmd_loss"] == pytest.approx(0.5 * (g**2).mean().item(), rel=1e-5)
    assert prepared.guidance_scale == 1.0 and prepared.frozen_networks == ()


def reward_guided_ctx(weight: float):
    """The actor's context with a linear differentiable latent reward (reward_pairs.py) at --dmd2-reward-weight."""
    run = default_args(loss_type="dmd2", rm_type="custom", custom_rm_path=f"{REWARD_FILE}:rm")
    return make_ctx(role="actor", **{**vars(run), **make_ctx().args.__dict__, "dmd2_reward_weight": weight})


@pytest.mark.parametrize("hinge", [None, 1e6])
def test_reward_guided_gradient_is_dmd2s_plus_lambda_times_the_rewards_alone(hinge):
    """--dmd2-reward-weight λ: the generator's gradient is dmd2's plus λ times that of φ(R(x_θ)) alone; λ = 0 is dmd2
    exactly (same loss, same gradient, no reward metric)."""
    pairs = make_pairs()
    g = torch.randn(P, C, H, W, generator=torch.Generator().manual_seed(3))
    pairs["peer/dmd_target"] = pairs["x"] - g
    pairs["reward_metadata"] = encode_json_column([{"gain": 1.0 + i} for i in range(P)])
    grads, losses, means = {}, {}, {}
    for weight in (0.0, 0.5):
        ctx = reward_guided_ctx(weight)
        ctx.args.dmd2_reward_hinge = hinge
        prepared = prepare_generator_batch(ctx, pairs, microbatch_id=0, optim_step_idx=0)
        v = torch.zeros(P, C, H, W, requires_grad=True)
        metrics = WindowMetrics()
        losses[weight] = formula(generator_formula, ctx, pairs, prepared, v, metrics=metrics)
        losses[weight].backward()
        grads[weight], means[weight] = v.grad, metrics.means()
    plain_ctx = make_ctx(role="actor")
    prepared = prepare_generator_batch(plain_ctx, pairs, microbatch_id=0, optim_step_idx=0)
    v = torch.zeros(P, C, H, W, requires_grad=True)
    plain = formula(generator_formula, plain_ctx, pairs, prepared, v)
    plain.backward()
    assert torch.equal(losses[0.0], plain) and torch.equal(grads[0.0], v.grad)
    assert "train/dmd2_reward_mean" not in means[0.0] and "train/dmd2_reward_mean" in means[0.5]
    assert means[0.5]["train/dmd_loss"] == means[0.0]["train/dmd_loss"]  # the reward term is logged apart
    assert means[0.5]["train/loss"] == pytest.approx(means[0.0]["train/loss"] + means[0.5]["train/dmd2_reward_loss"])
    # ∂(λ·φ(R(x_θ)))/∂v with x_θ = x_t − σ·v, R = gain·Σ w ⊙ x_θ: φ = −R gives +λ·σ·gain·w, the active hinge too
    gains = torch.arange(1.0, P + 1).reshape(-1, 1, 1, 1)
    reward_grad = 0.5 * 0.75 * gains * pattern((C, H, W))
    torch.testing.assert_close(grads[0.5] - grads[0.0], reward_grad, rtol=1e-5, atol=1e-7)


def test_generator_without_the_critic_target_names_the_column():
    ctx, pairs = make_ctx(role="actor"), make_pairs()
    prepared = prepare_generator_batch(ctx, pairs, microbatch_id=0, optim_step_idx=0)
    with pytest.raises(KeyError, match="peer/dmd_target"):
        formula(generator_formula, ctx, pairs, prepared, torch.zeros(P, C, H, W))


DMD2_ARGV = [
    "--hf-checkpoint",
    "/tmp/x",
    "--prompt-data",
    "builtin:shapes",
    "--loss-type",
    "dmd2",
    "--teacher-load",
    "/t",
]


def test_critic_windows_follow_the_update_ratio_unless_given():
    from miles.arguments.parser import parse_args

    args = parse_args(DMD2_ARGV + ["--num-steps-per-rollout", "2", "--dmd2-critic-updates-per-step", "3"])
    assert args.critic_num_steps_per_rollout == 6
    assert parse_args(DMD2_ARGV).critic_num_steps_per_rollout == 5
    given = parse_args(DMD2_ARGV + ["--critic-num-steps-per-rollout", "4"])
    assert given.critic_num_steps_per_rollout == 4


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--dmd2-generator-steps", "5"], "--dmd2-generator-steps must be in [1, 4]"),
        (["--dmd2-generator-steps", "0"], "--dmd2-generator-steps must be in [1, 4]"),
        (["--dmd2-critic-updates-per-step", "0"], "--dmd2-critic-updates-per-step"),
        (["--dmd2-t-min", "0.5", "--dmd2-t-max", "0.4"], "--dmd2-t-min"),
        (["--dmd2-real-guidance-scale", "0.5"], "--dmd2-real-guidance-scale"),
    ],
)
def test_dmd2_flag_rules_name_the_flags(capsys, extra, message):
    from miles.arguments.parser import parse_args

    with pytest.raises(SystemExit):
        parse_args(DMD2_ARGV + extra)
    assert message in capsys.readouterr().err
