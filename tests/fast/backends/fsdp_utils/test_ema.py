"""Shadow weights (EMA / NFT old policy) against plain tensor arithmetic: in-process, and under FSDP2 at world sizes
1 (in-process gloo) and 2 (spawned ranks) against an unsharded copy of the same training."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from miles.arguments.parser import default_args
from miles.backends.fsdp_utils.ema import EmaConfig, ShadowWeights, ema_config_from_args, ema_decay, swap_bits_
from miles.backends.fsdp_utils.gather import full_state_dict
from miles.diffusion.shadow import old_policy_decay
from miles.utils.distributed import destroy_process_group, find_free_port, init_process_group
from tests.fast.backends.fsdp_utils.fsdp_workers import (
    BATCH,
    LR,
    WEIGHT_DECAY,
    build_fsdp_model,
    build_model,
    fixed_batch,
    run_ranks,
)

STEPS = 3
DECAY = 0.8
WARMUP = "power"
REF_STEP = 1  # the step whose policy forward is followed by a shadow (ref) forward before its backward


# ---- schedules and config ---------------------------------------------------------------------------------------
def test_ema_decay_schedules():
    assert ema_decay(0, decay=0.995) == 0.995
    assert ema_decay(7, decay=0.995, warmup="none") == 0.995
    assert ema_decay(0, decay=0.995, warmup="power") == pytest.approx(1 / 10)
    assert ema_decay(5, decay=0.995, warmup="power") == pytest.approx(6 / 15)
    assert ema_decay(10_000, decay=0.995, warmup="power") == 0.995
    with pytest.raises(ValueError, match="--ema-warmup"):
        ema_decay(0, decay=0.9, warmup="cosine")
    with pytest.raises(ValueError, match="--ema-decay"):
        ema_decay(0, decay=1.5)


def test_ema_config_from_args_defaults_and_interval():
    config = ema_config_from_args(default_args())
    assert config == EmaConfig(enabled=False, decay=0.995, warmup="power", update_interval=1)
    assert not config.due(1)
    config = ema_config_from_args(default_args(use_ema=True, ema_decay=0.9, ema_warmup="power", ema_update_interval=2))
    assert [config.due(step) for step in (1, 2, 3, 4)] == [False, True, False, True]
    assert config.decay_at(1) == pytest.approx(1 / 10)  # after the first optimizer step
    assert config.decay_at(3) == pytest.approx(3 / 12)
    with pytest.raises(ValueError, match="--ema-update-interval"):
        EmaConfig(enabled=True, update_interval=0)


# ---- plain (unsharded) modules --------------------------------------------------------------------------------------
def _perturb(model: nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen))


def test_update_matches_formula_on_plain_tensors():
    model = build_model(0)
    start = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    shadow = ShadowWeights(model)
    _perturb(model, 1)
    shadow.update(0.7)
    for name, p in model.named_parameters():
        expected = 0.7 * start[name] + 0.3 * p.detach().double()
        torch.testing.assert_close(shadow.state_dict()[name].double(), expected, atol=1e-6, rtol=0, msg=name)


def test_decay_zero_makes_shadow_equal_live():
    model = build_model(0)
    shadow = ShadowWeights(model)
    _perturb(model, 2)
    shadow.update(old_policy_decay(0))  # NFT's schedule starts at d = 0: old = current
    for name, p in model.named_parameters():
        assert torch.equal(shadow.state_dict()[name], p.detach()), name


def test_frozen_parameters_are_not_shadowed():
    model = build_model(0)
    model.head.requires_grad_(False)
    assert set(ShadowWeights(model).state_dict()) == {n for n, p in model.named_parameters() if p.requires_grad}


def test_swapped_in_uses_shadow_and_restores_bfloat16_bitwise():
    model = build_model(0).to(torch.bfloat16)
    shadow = ShadowWeights(model)
    _perturb(model, 3)
    live = {n: p.detach().clone() for n, p in model.named_parameters()}
    with shadow.swapped_in(model):
        for name, p in model.named_parameters():
            assert torch.equal(p, shadow.state_dict()[name].to(torch.bfloat16)), name
    for name, p in model.named_parameters():
        assert torch.equal(p, live[name]), name


class RecordedOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_swapped_in_exchanges_float32_shards_with_the_shadow_without_a_copy():
    model = build_model(0)
    shadow = ShadowWeights(model)
    _perturb(model, 4)
    live = {n: p.detach().clone() for n, p in model.named_parameters()}
    theta_s = {n: t.clone() for n, t in shadow.state_dict().items()}
    recorded = RecordedOps()
    with recorded, shadow.swapped_in(model):
        for name, p in model.named_parameters():
            assert torch.equal(p, theta_s[name]) and torch.equal(shadow.state_dict()[name], live[name]), name
    allocating = [op for op in recorded.ops if op.startswith(("clone", "empty", "_to_copy", "copy"))]
    assert not allocating and recorded.ops.count("bitwise_xor_.Tensor") == 2 * 3 * len(live)
    for name, p in model.named_parameters():
        assert torch.equal(p, live[name]) and torch.equal(shadow.state_dict()[name], theta_s[name]), name


def test_swap_bits_is_exact_for_nan_and_negative_zero_and_refuses_other_dtypes():
    a = torch.tensor([float("nan"), -0.0, 1e-45, 3.0])
    b = torch.tensor([1.0, float("inf"), -2.5, 0.0])
    bits_a, bits_b = a.view(torch.int32).clone(), b.view(torch.int32).clone()
    swap_bits_(a, b)
    assert torch.equal(a.view(torch.int32), bits_b) and torch.equal(b.view(torch.int32), bits_a)
    with pytest.raises(ValueError, match="one dtype and shape"):
        swap_bits_(a, b.double())


def test_swapped_in_rejects_another_model_and_network_needs_no_grad():
    shadow = ShadowWeights(build_model(0))
    with pytest.raises(ValueError, match="different model"), shadow.swapped_in(build_model(0)):
        pass
    model = build_model(0)
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="no_grad"):
        ShadowWeights(model).network(model)(x)


def test_state_dict_round_trip(tmp_path):
    model = build_model(0)
    shadow = ShadowWeights(model)
    _perturb(model, 4)
    shadow.update(0.5)
    torch.save(shadow.state_dict(), tmp_path / "ema.pt")
    other = ShadowWeights(model)  # starts from the live weights
    other.load_state_dict(torch.load(tmp_path / "ema.pt"))
    for name, value in shadow.state_dict().items():
        assert torch.equal(other.state_dict()[name], value), name
    with pytest.raises(KeyError, match="missing"):
        other.load_state_dict({})


# ---- FSDP2: the same training sharded over 1 and 2 ranks vs a plain loop ------------------------------------------
def _chunk(world_size: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = fixed_batch()
    return x.chunk(world_size)[rank], y.chunk(world_size)[rank]


def ema_training(rank: int, world_size: int, out_dir: str) -> dict:
    """AdamW on the FSDP2 block model with an EMA updated after each step; at REF_STEP a shadow forward runs between
    the policy forward and its backward. Reports gathered shadow/live weights, the ref output, and round trips."""
    model = build_fsdp_model(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    shadow = ShadowWeights(model)
    x_local, y_local = _chunk(world_size, rank)
    ref_out = None
    for step in range(STEPS):
        optimizer.zero_grad()
        out = model(x_local)
        if step == REF_STEP:
            with torch.no_grad():
                ref_out = shadow.network(model)(x_local)
        (((out - y_local) ** 2).mean(dim=1).sum() * world_size / BATCH).backward()
        optimizer.step()
        shadow.update(ema_decay(step, decay=DECAY, warmup=WARMUP))

    local_before = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
    gathered_shadow = shadow.full_state_dict(model, cpu_offload=False)
    restored = all(torch.equal(p.to_local(), local_before[n]) for n, p in model.named_parameters())
    live = full_state_dict(model, cpu_offload=False)

    torch.save(shadow.state_dict(), os.path.join(out_dir, f"ema_rank{rank}.pt"))
    reloaded = ShadowWeights(model)
    reloaded.load_state_dict(torch.load(os.path.join(out_dir, f"ema_rank{rank}.pt"), weights_only=False))
    dcp.save({"ema": shadow.state_dict()}, checkpoint_id=os.path.join(out_dir, "dcp"))
    return {
        "all_dtensor": all(type(v).__name__ == "DTensor" for v in shadow.state_dict().values()),
        "shadow": {k: v.detach().cpu().clone() for k, v in gathered_shadow.items()},
        "live": {k: v.detach().cpu().clone() for k, v in live.items()},
        "restored_bitwise": restored,
        "ref_out": ref_out,
        "round_trip": all(
            torch.equal(a.to_local(), b.to_local())
            for a, b in zip(shadow.state_dict().values(), reloaded.state_dict().values())
        ),
    }


@pytest.fixture(scope="module")
def plain_reference() -> dict:
    """The same training unsharded on the full batch, with the EMA written out as d·s + (1 − d)·θ in float64."""
    model = build_model(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    x, y = fixed_batch()
    ema = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    ema_at_ref = None
    for step in range(STEPS):
        if step == REF_STEP:
            ema_at_ref = {n: v.float().clone() for n, v in ema.items()}
        optimizer.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        optimizer.step()
        d = min(DECAY, (1 + step) / (10 + step))
        ema = {n: d * ema[n] + (1 - d) * p.detach().double() for n, p in model.named_parameters()}
    ref_model = build_model(0)
    ref_model.load_state_dict(ema_at_ref)
    with torch.no_grad():
        ref_out = ref_model(x)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"params": params, "ema": {n: v.float() for n, v in ema.items()}, "ref_out": ref_out}


@pytest.fixture(scope="module")
def gloo_world_of_one():
    init_process_group(0, 1, "127.0.0.1", find_free_port(), "cpu", timeout=timedelta(seconds=60))
    yield
    destroy_process_group()


@pytest.fixture(scope="module")
def results(gloo_world_of_one, tmp_path_factory) -> dict[int, tuple[str, list[dict]]]:
    """world size -> (out dir, per-rank reports of `ema_training`): size 1 in this process, size 2 spawned."""
    one_dir, two_dir = str(tmp_path_factory.mktemp("ema_ws1")), str(tmp_path_factory.mktemp("ema_ws2"))
    return {1: (one_dir, [ema_training(0, 1, one_dir)]), 2: (two_dir, run_ranks(ema_training, 2, two_dir))}


@pytest.mark.parametrize("world_size", [1, 2])
def test_fsdp_shadow_equals_ema_of_plain_training(results, plain_reference, world_size):
    for report in results[world_size][1]:
        assert report["all_dtensor"]  # kept as shards, never gathered for the update
        assert report["restored_bitwise"]
        assert report["round_trip"]
        for name, expected in plain_reference["ema"].items():
            torch.testing.assert_close(report["shadow"][name], expected, atol=1e-6, rtol=0, msg=name)
        for name, expected in plain_reference["params"].items():  # the ref forward did not disturb the gradients
            torch.testing.assert_close(report["live"][name], expected, atol=1e-6, rtol=0, msg=name)


@pytest.mark.parametrize("world_size", [1, 2])
def test_fsdp_ref_forward_between_forward_and_backward_uses_shadow(results, plain_reference, world_size):
    outs = torch.cat([report["ref_out"] for report in results[world_size][1]])
    torch.testing.assert_close(outs, plain_reference["ref_out"], atol=1e-6, rtol=0)


def test_dcp_save_at_two_ranks_loads_at_one(results, plain_reference):
    model = build_fsdp_model(5)
    shadow = ShadowWeights(model)
    state = shadow.state_dict()
    dcp.load({"ema": state}, checkpoint_id=os.path.join(results[2][0], "dcp"))
    shadow.load_state_dict(state)
    gathered = shadow.full_state_dict(model)
    for name, expected in plain_reference["ema"].items():
        torch.testing.assert_close(gathered[name], expected, atol=1e-6, rtol=0, msg=name)
