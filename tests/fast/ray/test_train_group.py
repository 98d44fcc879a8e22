"""The trunk through real Ray actors: FSDP2 equivalence with a plain loop, rank agreement, hook wiring."""

import copy
import os
from types import MappingProxyType

import pytest
import torch

from miles.arguments.parser import parse_args
from miles.backends.fsdp_utils.loss_hub import sft
from miles.backends.fsdp_utils.loss_hub.types import DiffusionLossContext
from miles.models.base import get_train_pipeline_config
from miles.ray.actor_pool import current_pool
from miles.utils.box import put_box
from miles.utils.types import shard_pairs, slice_pairs

HERE = os.path.dirname(__file__)
RECORDING = os.path.join(HERE, "..", "backends", "fsdp_utils", "recording_hooks.py")
TIMEOUT = 240


def trunk_args(pipeline_dir, dp_size, *extra):
    argv = [
        "--hf-checkpoint",
        pipeline_dir,
        "--prompt-data",
        "builtin:shapes",
        "--loss-type",
        "sft_loss",
        "--train-only",
        "--n-samples-per-prompt",
        "1",
        "--dp-size",
        str(dp_size),
        "--rollout-batch-size",
        "8",
        "--global-batch-size",
        "4",
        "--num-steps-per-rollout",
        "2",
        "--micro-batch-size",
        "2",
        "--lr",
        "1e-3",
        "--clip-grad",
        "0.5",
        "--cpus-per-rank",
        "0.5",
        "--log-level",
        "WARNING",
        *extra,
    ]
    return parse_args(argv)


@pytest.fixture(scope="module")
def family(tiny_pipeline_dir):
    fam = get_train_pipeline_config(tiny_pipeline_dir)
    fam.load_text_encoders()
    return fam


def make_pairs(family, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    embeds = family.encode_prompts([f"{['one', 'two', 'three'][i % 3]} red circles on the left" for i in range(n)])
    return {
        "x0": torch.randn((n, *family.latent_shape()), generator=g),
        **embeds.to(dtype=torch.float32).to_columns(),
    }


def reference_training(args, family, pairs, rollout_id=0):
    """Plain single-process PyTorch: same model, data and noise; full-batch mean loss, clip, AdamW."""
    model = family.load_transformer()
    model.train()
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=args.lr,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_eps,
        weight_decay=args.weight_decay,
    )
    shards = shard_pairs(pairs, args.dp_size)
    per_rank = shards[0]["x0"].shape[0]
    per_window = per_rank // args.num_steps_per_rollout
    for window in range(args.num_steps_per_rollout):
        opt.zero_grad()
        total = 0.0
        for rank, shard in enumerate(shards):
            ctx = DiffusionLossContext(
                args=args,
                role="actor",
                rollout_id=rollout_id,
                dp_rank=rank,
                dp_size=args.dp_size,
                device=torch.device("cpu"),
                forward_dtype=torch.float32,
                family=family,
                networks=MappingProxyType({}),
            )
            mb_id = window * ((per_window + args.micro_batch_size - 1) // args.micro_batch_size)
            for start in range(0, per_window, args.micro_batch_size):
                lo = window * per_window + start
                batch = slice_pairs(shard, lo, min(lo + args.micro_batch_size, (window + 1) * per_window))
                prepared = sft.prepare_sft_batch(ctx, batch, microbatch_id=mb_id, optim_step_idx=window)
                v = model(
                    hidden_states=prepared.latents,
                    encoder_hidden_states=prepared.embeds["prompt_embeds"],
                    pooled_projections=prepared.embeds["pooled_prompt_embeds"],
                    timestep=prepared.sigmas * 1000,
                    return_dict=False,
                )[0]
                target = prepared.extras["noise"] - prepared.extras["x0"]
                total = total + ((v.float() - target) ** 2).mean(dim=(1, 2, 3)).sum()
                mb_id += 1
        (total / (per_window * args.dp_size)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
        opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("dp_size", [1, 2])
def test_fsdp2_group_matches_plain_pytorch_after_two_adamw_steps(ray_cluster, tiny_pipeline_dir, family, dp_size):
    from miles.ray.train_group import RayTrainGroup

    args = trunk_args(tiny_pipeline_dir, dp_size)
    pairs = make_pairs(family, 8)
    group = RayTrainGroup(args, "actor", timeout=TIMEOUT, pool=current_pool())
    try:
        assert group.init() == 0
        group.train(0, [put_box(s) for s in shard_pairs(pairs, dp_size)])
        metrics = group.pop_metrics()
        full = group.call("full_state_dict_every_rank")
    finally:
        group.shutdown()
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(torch.isfinite(torch.tensor(m["train/loss"])) for m in metrics)
    expected = reference_training(copy.deepcopy(args), family, pairs)
    for rank_state in full[1:]:
        for name, value in rank_state.items():
            assert torch.equal(value, full[0][name]), f"rank disagreement on {name}"
    worst = max((full[0][k] - expected[k]).abs().max().item() for k in expected)
    assert worst < 2e-5, f"FSDP2 (dp={dp_size}) differs from the plain loop by {worst}"


def recording_args(tiny_pipeline_dir, *extra):
    return trunk_args(
        tiny_pipeline_dir,
        2,
        "--algorithm-path",
        RECORDING,
        "--loss-type",
        "recording",
        "--diffusion-recompute-old-log-prob",
        "--rollout-batch-size",
        "12",
        "--global-batch-size",
        "4",
        "--num-steps-per-rollout",
        "3",
        "--micro-batch-size",
        "1",
        *extra,
    )


def train_recording(args, family) -> tuple[list[dict], list[dict]]:
    """One train call of the recording hooks on a dp-2 group: (each rank's output, each rank's full weights)."""
    from miles.ray.train_group import RayTrainGroup

    group = RayTrainGroup(args, "actor", timeout=TIMEOUT, pool=current_pool())
    try:
        group.init()
        boxes = group.train(0, [put_box(s) for s in shard_pairs(make_pairs(family, 12), 2)])
        outputs = [box.get(timeout=TIMEOUT) for box in boxes]
        weights = group.call("full_state_dict_every_rank")
    finally:
        group.shutdown()
    return outputs, weights


def test_hook_wiring_numbering_in_recompute_and_training_loops_with_and_without_prefetch(
    ray_cluster, tiny_pipeline_dir, family
):
    """The hooks' calls and numbering in both loops; --prefetch-microbatches on calls them identically (the
    prepares on the worker thread, same order, ids and grad mode) and trains bit-identically (three AdamW steps)."""
    runs = {mode: train_recording(recording_args(tiny_pipeline_dir, "--prefetch-microbatches", mode), family)
            for mode in ("off", "on")}  # fmt: skip
    (outputs, off_weights), (on_outputs, on_weights) = runs["off"], runs["on"]
    windows, per_window = 3, 2  # 6 pairs per rank: 3 windows of 2 micro-batches of 1 pair
    recompute = [(w * per_window + m, w, True) for w in range(1, windows) for m in range(per_window)]
    training = [(w * per_window + m, w, False) for w in range(windows) for m in range(per_window)]
    for out in outputs:
        seen = [(c["microbatch_id"], c["optim_step_idx"], c["write_old_log_prob"]) for c in out["calls"]]
        assert seen == recompute + training
        assert all(c["prepare_step"] == c["optim_step_idx"] for c in out["calls"])
        from_new = [c["old_log_prob_from_new"] for c in out["calls"]]
        assert from_new == [False] * len(recompute) + [w == 0 for (_, w, _) in training]
        assert out["same_list"], "train_output did not receive the list the formulas appended to"
        assert out["appended"] == [mb for mb, _, _ in recompute + training]
        assert [(mb, step, grad) for mb, step, grad, *_ in out["prepares"]] == [
            (mb, w, not recompute_call) for mb, w, recompute_call in recompute + training
        ]  # the recompute loop prepares without grad
        assert all(main for *_, main, _ in out["prepares"])
        assert all(pad is None for *_, pad in out["prepares"])  # passed explicitly: the hook has no default
    for off, on in zip(outputs, on_outputs):
        assert [p[:3] for p in on["prepares"]] == [p[:3] for p in off["prepares"]]
        assert on["calls"] == off["calls"] and on["appended"] == off["appended"]
        assert not any(main for *_, main, _ in on["prepares"]), "prefetch on, yet a prepare ran on the main thread"
    for off, on in zip(off_weights, on_weights):
        assert off.keys() == on.keys()
        for name in off:
            assert torch.equal(off[name], on[name]), f"{name} differs with prefetch"


def test_a_sleeping_rank_holds_no_state_and_wakes_bit_for_bit(ray_cluster, tiny_pipeline_dir, family):
    """--colocate-sleep: sleep frees every storage a rank keeps between calls (shards, optimizer state, EMA), wake
    brings back the same bits, and a call that needs the weights (train) wakes a sleeping rank itself."""
    import ray

    from miles.ray.train_group import RayTrainGroup

    def snapshot(actor):  # runs inside each rank
        return [t.detach().clone() for t in actor._resident_tensors()]

    def resident_bytes(actor):
        return sum(t.untyped_storage().nbytes() for t in actor._resident_tensors())

    def on_ranks(fn):
        return ray.get([a.__ray_call__.remote(fn) for a in group.actors], timeout=TIMEOUT)

    args = trunk_args(tiny_pipeline_dir, 2, "--use-ema", "--ema-decay", "0.5")
    shards = [put_box(s) for s in shard_pairs(make_pairs(family, 8), 2)]
    group = RayTrainGroup(args, "actor", timeout=TIMEOUT, pool=current_pool())
    try:
        group.init()
        group.train(0, shards)
        before, held = on_ranks(snapshot), on_ranks(resident_bytes)
        reports = group.sleep()
        asleep = on_ranks(resident_bytes)
        group.wake()
        after = on_ranks(snapshot)
        group.sleep()
        group.train(1, shards)  # wakes the ranks
        metrics = group.pop_metrics()
    finally:
        group.shutdown()
    # left in place: buffers diffusers builds from NumPy arrays (SD3's pos_embed), whose storage cannot be resized
    assert asleep == [r["kept_bytes"] for r in reports] and all(k < h / 10 for k, h in zip(asleep, held))
    assert [r["copied_bytes"] + r["kept_bytes"] for r in reports] == held
    assert all(r["discarded_bytes"] == 0 for r in reports)
    for rank_before, rank_after in zip(before, after):
        # parameters, AdamW's exp_avg / exp_avg_sq (and step, on the device), the EMA shadow: all of it, same bits
        assert len(rank_before) == len(rank_after) > 3 * len(list(family.load_transformer().parameters()))
        assert all(torch.equal(a, b) for a, b in zip(rank_before, rank_after))
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
