"""The bf16 trainer computes the engines' function: FSDP2 casts no block input, diffusers' fp32 modules stay fp32,
buffers are held as `from_pretrained(dtype=bf16)` holds them; checked against the engine's plain diffusers module."""

from __future__ import annotations

import pytest
import torch

from miles.backends.fsdp_utils.fsdp import cast_buffers_as_loaded, keep_in_fp32_names
from miles.models.base import get_train_pipeline_config
from tests.fast.backends.fsdp_utils.fsdp_workers import run_ranks
from tests.fast.backends.fsdp_utils.precision_workers import engine_and_trainer, write_case

WAN = {"num_frames": 5}


def test_keep_in_fp32_names_are_the_parameters_diffusers_loads_in_fp32(tiny_wan_dir, tiny_flux_dev_dir):
    family = get_train_pipeline_config(tiny_wan_dir, **WAN)
    loaded = family.load_transformer(dtype=torch.bfloat16)
    fp32 = {name for name, p in loaded.named_parameters() if p.dtype == torch.float32}
    names = keep_in_fp32_names(family.load_transformer())
    assert fp32 and names & {name for name, _ in loaded.named_parameters()} == fp32
    assert {"rope.freqs_cos", "rope.freqs_sin"} <= names  # Wan's `rope` is listed: its buffers match too
    assert keep_in_fp32_names(get_train_pipeline_config(tiny_flux_dev_dir).load_transformer()) == set()


@pytest.mark.parametrize(("fixture", "options"), [("tiny_pipeline_dir", {}), ("tiny_wan_dir", WAN)])
def test_buffers_are_held_as_from_pretrained_holds_them(request, fixture, options):
    """SD3's persistent `pos_embed` table goes to bf16 (at fp32 the trainer added it to bf16 patches in fp32, the
    engine in bf16: one ulp apart); Wan's non-persistent rotary tables stay fp32."""
    family = get_train_pipeline_config(request.getfixturevalue(fixture), **options)
    engine = family.load_transformer(dtype=torch.bfloat16)
    trainer = family.load_transformer()
    cast_buffers_as_loaded(trainer, torch.bfloat16, keep_in_fp32_names(trainer))
    buffers = dict(engine.named_buffers())
    assert buffers and {n: b.dtype for n, b in trainer.named_buffers()} == {n: b.dtype for n, b in buffers.items()}
    assert all(torch.equal(b, buffers[n]) for n, b in trainer.named_buffers())


@pytest.mark.parametrize("world_size", [1, 2])
def test_sharded_bf16_wan_computes_the_engines_velocity_bit_for_bit(tiny_wan_dir, tmp_path, world_size):
    """Wan at world size 1 (one root group before) and 2 (a group per block): its fp32 rotary tables reach the
    blocks uncast, `time_embedder`, `norm2` and `scale_shift_table` compute in fp32, with activation checkpointing.
    Gradients: the same up to the order bf16 gradient contributions are summed in (FSDP2 adds an autograd node per
    group input), within one bf16 ulp of each tensor's largest entry; the fp32 parameters' gradients exactly."""
    report = run_ranks(engine_and_trainer, world_size, write_case(str(tmp_path), tiny_wan_dir, **WAN), timeout=240)[0]
    engine, trainer = report["engine"], report["trainer"]
    assert report["block_inputs"]["trainer"] == report["block_inputs"]["engine"]
    assert torch.float32 in report["block_inputs"]["engine"]  # the rotary cos / sin
    assert torch.equal(trainer["velocity"], engine["velocity"])
    assert sorted(trainer["grads"]) == sorted(engine["grads"])
    kept = keep_in_fp32_names(get_train_pipeline_config(tiny_wan_dir, **WAN).load_transformer())
    for name, grad in engine["grads"].items():
        if name in kept:
            assert torch.equal(trainer["grads"][name], grad), name
        else:
            assert (trainer["grads"][name] - grad).abs().max() <= 2**-7 * grad.abs().max(), name
