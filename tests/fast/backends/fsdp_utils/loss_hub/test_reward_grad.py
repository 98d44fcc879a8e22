"""The reward-gradient train side's shared pieces: the trained rewards of --rm-type (weighted built-ins and a user's
custom differentiable reward; a non-differentiable one refused by name), a latent of any rank scored with gradient
(a video family's latents with a latent reward), an image reward through the family's decode, the pairs' metadata,
and the objective with its copies and reference-velocity penalty."""

from dataclasses import replace

import pytest
import torch

from miles.backends.fsdp_utils.loss_hub.reward_grad import (
    decoded_pixels,
    differentiable_rewards,
    pair_metadatas,
    prepare_reward_batch,
    reward_loss,
    score_x0,
)
from miles.backends.fsdp_utils.loss_hub.types import WindowMetrics
from miles.models.media import Media
from miles.models.shapes_reward.differentiable import BUILTIN_DIFFERENTIABLE
from tests.fast.backends.fsdp_utils.loss_hub.reward_pairs import THIS_FILE, gain, make_batch, make_ctx, pattern


def test_the_trained_rewards_are_the_weighted_differentiable_ones():
    ctx = make_ctx(rm_type="shapes_learned:2,shapes:0", custom_rm_path=None)
    [term] = differentiable_rewards(ctx.args)
    assert (term.name, term.weight, term.reward) == ("shapes_learned", 2.0, BUILTIN_DIFFERENTIABLE["shapes_learned"])
    [custom] = differentiable_rewards(make_ctx().args)
    assert custom.name == "custom" and custom.reward.inputs == "latent"
    with pytest.raises(ValueError, match=r"--rm-type shapes:1 is not differentiable"):
        differentiable_rewards(make_ctx(rm_type="shapes", custom_rm_path=None).args)
    with pytest.raises(ValueError, match=r"has no `differentiable` attribute"):
        differentiable_rewards(make_ctx(custom_rm_path=f"{THIS_FILE}:plain_rm").args)


def test_a_video_latent_is_scored_with_gradient_by_a_latent_reward():
    ctx = make_ctx()
    x0 = torch.randn(2, 4, 3, 2, 2, requires_grad=True)  # (B, C, F, H, W): a video family's latent
    metadatas = [{"gain": 1.0}, {"gain": 3.0}]
    reward = score_x0(ctx, x0, metadatas)
    expected = torch.tensor([gain(m) for m in metadatas]) * (x0 * pattern((4, 3, 2, 2))).flatten(1).sum(1)
    torch.testing.assert_close(reward, expected)
    reward.sum().backward()
    torch.testing.assert_close(x0.grad[1], 3.0 * pattern((4, 3, 2, 2)))


class _Vae(torch.nn.Module):
    device = torch.device("cpu")


class _Family:
    """A family whose decode is the sigmoid of the first three latent channels, upsampled to 32 px."""

    loaded = 0

    def cached_vae(self):
        return _Vae()

    def load_vae(self, device):
        self.loaded += 1

    def decode_latents(self, x0):
        return Media(torch.nn.functional.interpolate(torch.sigmoid(x0[:, :3]), size=(32, 32)))


def test_an_image_reward_scores_the_decode_with_gradient_into_the_latent():
    ctx = replace(make_ctx(rm_type="shapes_learned", custom_rm_path=None), family=_Family())
    x0 = torch.randn(2, 4, 8, 8, requires_grad=True)
    metadatas = [{"color": "red", "shape": "circle", "count": 1, "position": "left"}] * 2
    reward = score_x0(ctx, x0, metadatas)
    with torch.no_grad():
        expected = BUILTIN_DIFFERENTIABLE["shapes_learned"].score(ctx.args, decoded_pixels(ctx, x0), metadatas)
    torch.testing.assert_close(reward, expected)
    reward.sum().backward()
    assert float(x0.grad[:, :3].abs().sum()) > 0 and float(x0.grad[:, 3].abs().sum()) == 0
    assert ctx.family.loaded == 0  # the VAE is on the trainer's device already


def test_metadata_copies_and_the_prepare_repeat_rows_per_pair():
    ctx, batch = make_ctx(), make_batch()
    assert pair_metadatas(batch, copies=2)[:3] == [{"gain": 1.0}, {"gain": 1.0}, {"gain": 2.0}]
    rows = batch["latents"].repeat_interleave(2, dim=0)
    prepared = prepare_reward_batch(ctx, batch, rows, batch["sigma"].repeat_interleave(2), copies=2)
    assert prepared.embeds.batch_size == 6 and prepared.frozen_networks == ()
    torch.testing.assert_close(prepared.embeds["prompt_embeds"][1], batch["cond/prompt_embeds"][0])
    with pytest.raises(KeyError, match="reward_metadata"):
        pair_metadatas({"latents": batch["latents"]})


def test_the_objective_averages_copies_and_adds_the_weighted_penalty():
    ctx = make_ctx(reward_grad_scale=2.0, reward_grad_hinge=1.0, reward_grad_kl_beta=0.5, ref_mode="ema")
    reward = torch.tensor([0.5, 1.5, 0.2, 0.4])  # two pairs of two copies
    v, v_ref = torch.ones(4, 3), torch.zeros(4, 3)
    metrics = WindowMetrics()
    loss = reward_loss(ctx, reward, v, {"ref": v_ref}, metrics, copies=2)
    per_row = 2.0 * torch.relu(1.0 - reward) + 0.5 * 1.0
    torch.testing.assert_close(loss, per_row.reshape(2, 2).mean(1).sum())
    assert metrics.means()["train/velocity_penalty"] == pytest.approx(1.0)
    with pytest.raises(KeyError, match="--reward-grad-kl-beta of --loss-type refl"):
        reward_loss(ctx, reward, v, {}, WindowMetrics(), copies=2)
