"""The planner's fake world (miles/plan/fake.py)."""

from __future__ import annotations

import torch


def test_per_tensor_equivalents_give_diffusers_tensors_and_are_restored():
    """The planner's loop-free HunyuanVideo 1.5 VAE attention mask equals diffusers' own (values, dtype, size)."""
    from diffusers.models.autoencoders.autoencoder_kl_hunyuanvideo15 import HunyuanVideo15AttnBlock

    from miles.plan.fake import per_tensor_equivalents

    own = HunyuanVideo15AttnBlock.prepare_causal_attention_mask
    cases = [(3, 4, None, torch.float32), (5, 7, 2, torch.float32), (2, 3, None, torch.bfloat16)]
    expected = [own(n, hw, dtype, "cpu", batch_size=b) for n, hw, b, dtype in cases]
    with per_tensor_equivalents():
        assert HunyuanVideo15AttnBlock.prepare_causal_attention_mask is not own
        got = [HunyuanVideo15AttnBlock.prepare_causal_attention_mask(n, hw, d, "cpu", b) for n, hw, b, d in cases]
    assert HunyuanVideo15AttnBlock.prepare_causal_attention_mask is own
    for a, b in zip(expected, got):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_a_cuda_plan_takes_the_trainers_cuda_choices_on_the_fake_cpu_device():
    """FSDP2's gathers keep their defaults and SD3's joint attention keeps q, k, v in a CUDA plan; a CPU plan (or a
    real run) keeps the CPU choices, and leaving restores them."""
    from miles.backends.fsdp_utils import fsdp, joint_attention
    from miles.plan.fake import device_paths

    states, cpu_gathers = torch.empty(1, 4, 8), fsdp.gather_one_group_at_a_time
    with device_paths("cuda"):
        assert not joint_attention._cpu_flash(states) and fsdp.gather_one_group_at_a_time is not cpu_gathers
    for planned, fake in (("cpu", True), ("cuda", False)):
        with device_paths(planned, fake):
            assert joint_attention._cpu_flash(states) and fsdp.gather_one_group_at_a_time is cpu_gathers
    assert joint_attention._cpu_flash(states) and fsdp.gather_one_group_at_a_time is cpu_gathers
