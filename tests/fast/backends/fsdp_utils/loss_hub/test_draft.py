"""The draft hooks: DRaFT-K asks the trunk for the K-step unroll over the rollout's own grid tail and scores its
result; DRaFT-LV lays out x_{N−1} and n re-noised copies of the detached sample per pair (noise seeded per pair row),
scores each row's one-step x̂₀ and averages them per pair; the first-step parity metric compares x_N with the
engine's final latents."""

import torch

from miles.backends.fsdp_utils.loss_hub import check_loss_hooks, get_loss_hooks
from miles.backends.fsdp_utils.loss_hub.draft import draft_formula, prepare_draft_batch
from tests.fast.backends.fsdp_utils.loss_hub.reward_pairs import B, call, make_batch, make_ctx, pattern


def test_the_hooks_pass_the_start_up_check():
    ctx = make_ctx("draft")
    check_loss_hooks(get_loss_hooks(ctx.args, "actor"))  # get_loss_hooks checks them against the declaration too


def test_draft_k_asks_for_the_unroll_over_the_grid_tail_and_scores_its_result():
    ctx, batch = make_ctx("draft", draft_k=2), make_batch()
    prepared = prepare_draft_batch(ctx, batch, microbatch_id=0, optim_step_idx=0)
    torch.testing.assert_close(prepared.unroll_sigmas, torch.tensor([0.3, 0.1, 0.0]))
    unrolled = batch["final_latents"].clone().requires_grad_(True)  # the trunk's x_N equal to the engine's
    loss, metrics = call(draft_formula, ctx, batch, prepared, torch.zeros_like(unrolled), unrolled=unrolled)
    gains = torch.tensor([1.0, 2.0, 3.0])
    torch.testing.assert_close(loss, -(gains * (unrolled.detach() * pattern((2, 4, 4))).flatten(1).sum(1)).sum())
    loss.backward()
    torch.testing.assert_close(unrolled.grad, -gains[:, None, None, None] * pattern((2, 4, 4)))
    assert metrics["train/draft_final_abs_diff"] == 0.0


def test_lv_lays_out_each_pair_then_its_copies_and_averages_their_rewards():
    ctx, batch = make_ctx("draft", draft_lv_copies=2), make_batch(sigma=0.1, sigma_next=0.0)
    prepared = prepare_draft_batch(ctx, batch, microbatch_id=0, optim_step_idx=0)
    rows = prepared.latents.reshape(B, 3, 2, 4, 4)
    assert torch.equal(rows[:, 0], batch["latents"]) and prepared.unroll_sigmas is None
    noise = (rows[:, 1:] - 0.9 * batch["final_latents"][:, None]) / 0.1  # the copies' ε, recovered
    assert abs(float(noise.std()) - 1.0) < 0.3 and not torch.allclose(noise[:, 0], noise[:, 1])
    again = prepare_draft_batch(ctx, batch, microbatch_id=5, optim_step_idx=0)
    assert torch.equal(again.latents, prepared.latents)  # seeded per pair row and window, not micro-batch
    assert prepared.embeds.batch_size == 3 * B and torch.equal(prepared.sigmas, torch.full((3 * B,), 0.1))
    v = torch.zeros(3 * B, 2, 4, 4, requires_grad=True)
    loss, metrics = call(draft_formula, ctx, batch, prepared, v)
    gains = torch.tensor([1.0, 2.0, 3.0]).repeat_interleave(3)
    per_row = -(gains * (prepared.latents * pattern((2, 4, 4))).flatten(1).sum(1))
    torch.testing.assert_close(loss, per_row.reshape(B, 3).mean(1).sum())
    x_n = batch["latents"]  # v = 0: the last Euler step leaves x_{N−1}
    diff = (x_n - batch["final_latents"]).flatten(1).abs().mean(1).mean()
    assert abs(metrics["train/draft_final_abs_diff"] - float(diff)) < 1e-6
