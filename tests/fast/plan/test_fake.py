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
