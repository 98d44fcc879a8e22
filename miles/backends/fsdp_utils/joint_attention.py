"""Joint attention (SD3's `JointAttnProcessor2_0`) that keeps its output once for backward, not twice.

diffusers' processor splits the projections into heads as `(batch, heads, tokens, head_dim)` views and concatenates
the image and text tokens in that layout, so the attention kernel writes its output in that layout too. The output is
then transposed back to `(batch, tokens, width)`, which copies it, and both copies stay for backward: the attention's
own (its backward reads its output) and the copy (the LoRA adapters of `to_out.0` and `to_add_out` keep their
input), 4.4 MiB each per 1024-wide block at 1133 tokens in fp32. `LeanJointAttnProcessor` concatenates the tokens in
the projections' own layout, `(batch, tokens, heads, head_dim)`, and hands the kernel transposed views of it: the
kernel writes its output in that layout, the transpose back is a view of it, and one copy stays. The values are the
same: every operation reads the same numbers in the same order, only where they lie in memory changes
(`tests/fast/backends/fsdp_utils/test_joint_attention.py`: outputs and gradients `torch.equal` on CPU, also with
SD3.5's q / k norms; on CUDA the flash kernels take the same strides, not measured here).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from diffusers.models.attention_processor import Attention, JointAttnProcessor2_0
from torch import nn


class LeanJointAttnProcessor(JointAttnProcessor2_0):
    """`JointAttnProcessor2_0` with the tokens concatenated in the projections' layout (see the module docstring).
    Inputs it does not handle the same way (4-D inputs, a mask) go to diffusers' processor."""

    def __call__(
        self,
        attn: Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        plain = hidden_states.ndim != 3 or (encoder_hidden_states is not None and encoder_hidden_states.ndim != 3)
        if plain or attention_mask is not None or args or kwargs:
            diffusers_call: Any = super().__call__  # typed for FloatTensor, called with what SD3 passes
            return diffusers_call(attn, hidden_states, encoder_hidden_states, attention_mask, *args, **kwargs)
        batch, image_tokens = hidden_states.shape[:2]
        query, key, value = _heads(attn, hidden_states, attn.to_q, attn.to_k, attn.to_v, attn.norm_q, attn.norm_k)
        if encoder_hidden_states is not None:
            text = _heads(
                attn,
                encoder_hidden_states,
                attn.add_q_proj,
                attn.add_k_proj,
                attn.add_v_proj,
                attn.norm_added_q,
                attn.norm_added_k,
            )
            query, key, value = (torch.cat([a, b], dim=1) for a, b in zip((query, key, value), text))
        out = F.scaled_dot_product_attention(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), dropout_p=0.0, is_causal=False
        )
        out = out.transpose(1, 2).reshape(batch, -1, attn.heads * query.shape[-1]).to(query.dtype)
        if encoder_hidden_states is None:
            return attn.to_out[1](attn.to_out[0](out))
        out, text_out = out[:, :image_tokens], out[:, image_tokens:]
        if not attn.context_pre_only:
            text_out = attn.to_add_out(text_out)
        return attn.to_out[1](attn.to_out[0](out)), text_out


def _heads(attn: Attention, states: torch.Tensor, *layers: nn.Module | None) -> tuple[torch.Tensor, ...]:
    """q, k, v of `states` as `(batch, tokens, heads, head_dim)` (no transpose), q and k normalised as diffusers
    does (its norms act on the last dimension)."""
    to_q, to_k, to_v, norm_q, norm_k = layers
    assert to_q is not None and to_k is not None and to_v is not None
    query, key, value = to_q(states), to_k(states), to_v(states)
    shape = (states.shape[0], -1, attn.heads, key.shape[-1] // attn.heads)
    query, key, value = query.view(shape), key.view(shape), value.view(shape)
    if norm_q is not None:
        query = norm_q(query)
    if norm_k is not None:
        key = norm_k(key)
    return query, key, value


def lean_joint_attention(model: nn.Module) -> int:
    """Give every attention of `model` that runs diffusers' `JointAttnProcessor2_0` (exactly that class) the lean
    processor; returns how many. Call before `fully_shard`."""
    count = 0
    for module in model.modules():
        if isinstance(module, Attention) and type(module.processor) is JointAttnProcessor2_0:
            module.set_processor(LeanJointAttnProcessor())
            count += 1
    return count
