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

With `recompute_qkv` (the default of `lean_joint_attention`, used where the attention runs torch's CPU flash kernel
with gradients) the kernel's q, k, v (3 of its 4 saved copies, 13.3 MiB of a 1024-wide block's 35.6 at 1133 tokens)
are not kept: `_QkvRecomputedAttention` keeps the projections' inputs (which their adapters kept anyway), the output
and the logsumexp, and backward projects q, k, v again with the same modules and runs the kernel's own backward on
them (outputs and gradients `torch.equal`). The cost is the six q / k / v projections (three of the image tokens,
three of the text tokens) again in backward: 3 * tokens * width^2 multiply-adds, 21% of an SD3 block's forward at
1024 wide and 1133 tokens. On CUDA (other kernels, other saved tensors) the processor keeps them. In SD3's joint
blocks with lean MLPs (`frozen_mlp._lean_block_forward`), `norm1` hands the attention its un-normalised input and
`modulation=(norm, scale, shift)`: the attention then keeps the stream (which the norm kept anyway) rather than the
modulated stream too, and its backward recomputes the norm and modulation with the projections (elementwise work).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from diffusers.models.attention_processor import Attention, JointAttnProcessor2_0
from torch import nn


class LeanJointAttnProcessor(JointAttnProcessor2_0):
    """`JointAttnProcessor2_0` with the tokens concatenated in the projections' layout (see the module docstring).
    Inputs it does not handle the same way (4-D inputs, a mask) go to diffusers' processor. With `recompute_qkv`
    (on CPU, with gradients) backward projects q, k, v again instead of keeping them (`_QkvRecomputedAttention`)."""

    def __init__(self, recompute_qkv: bool = False) -> None:
        super().__init__()
        self.recompute_qkv = recompute_qkv

    def __call__(
        self,
        attn: Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        *args: Any,
        modulation: tuple[nn.Module, torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> Any:
        plain = hidden_states.ndim != 3 or (encoder_hidden_states is not None and encoder_hidden_states.ndim != 3)
        recompute = self.recompute_qkv and torch.is_grad_enabled() and _cpu_flash(hidden_states)
        if modulation is not None and (plain or not recompute or any(t.requires_grad for t in modulation[1:])):
            hidden_states, modulation = _modulate(hidden_states, modulation), None
        if plain or attention_mask is not None or args or kwargs:
            diffusers_call: Any = super().__call__  # typed for FloatTensor, called with what SD3 passes
            return diffusers_call(attn, hidden_states, encoder_hidden_states, attention_mask, *args, **kwargs)
        batch, image_tokens = hidden_states.shape[:2]
        if recompute:
            params = _trained(attn)
            out = _QkvRecomputedAttention.apply(attn, hidden_states, encoder_hidden_states, modulation, *params)
        else:
            query, key, value = _joint_qkv(attn, hidden_states, encoder_hidden_states)
            out = F.scaled_dot_product_attention(query, key, value, dropout_p=0.0)
        out = out.transpose(1, 2).reshape(batch, -1, out.shape[1] * out.shape[-1])
        if encoder_hidden_states is None:
            return attn.to_out[1](attn.to_out[0](out))
        out, text_out = out[:, :image_tokens], out[:, image_tokens:]
        if not attn.context_pre_only:
            text_out = attn.to_add_out(text_out)
        return attn.to_out[1](attn.to_out[0](out)), text_out


class _QkvRecomputedAttention(torch.autograd.Function):
    """The joint attention from its (modulated) inputs to the kernel's output, keeping the inputs, the output and the
    kernel's logsumexp for backward, not q, k, v. Backward projects q, k, v again with the same modules (gradients
    enabled), runs the kernel's own backward on the saved output and logsumexp, and takes the gradients of the inputs
    and of the projections' trained weights (`params`, handed in so that autograd accumulates them) through the
    recomputed projections: the operations autograd runs without it, on the same numbers."""

    @staticmethod
    def forward(ctx: Any, attn: Attention, image: Any, text: Any, modulation: Any, *params: Any) -> Any:
        qkv = _joint_qkv(attn, image, text, modulation)
        out, logsumexp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(*qkv)
        ctx.attn, ctx.modulation = attn, modulation
        ctx.save_for_backward(image, text, out, logsumexp)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        image, text, out, logsumexp = ctx.saved_tensors
        needs = ctx.needs_input_grad
        inputs = [x.detach().requires_grad_(n) if x is not None else None for x, n in zip((image, text), needs[1:3])]
        with torch.enable_grad():
            qkv = _joint_qkv(ctx.attn, inputs[0], inputs[1], ctx.modulation)
        qkv_grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, *(x.detach() for x in qkv), out, logsumexp, 0.0, False
        )
        wanted = [x for x in inputs if x is not None and x.requires_grad] + list(_trained(ctx.attn))
        found = iter(torch.autograd.grad(qkv, wanted, qkv_grads, allow_unused=True))
        input_grads = [next(found) if x is not None and x.requires_grad else None for x in inputs]
        return None, *input_grads, None, *found


def _cpu_flash(states: torch.Tensor) -> bool:
    """Whether `F.scaled_dot_product_attention` runs the CPU flash kernel on these inputs' q, k, v (no mask, no
    dropout, 4-D views with a unit last stride: torch's own conditions then are the device, dtype and the switch)."""
    dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
    return states.device.type == "cpu" and states.dtype in dtypes and torch.backends.cuda.flash_sdp_enabled()


def _trained(attn: Attention) -> list[torch.Tensor]:
    """The q / k / v projections' (and q / k norms') weights that require gradients, in a fixed order."""
    names = ("to_q", "to_k", "to_v", "norm_q", "norm_k", "add_q_proj", "add_k_proj", "add_v_proj")
    modules = [getattr(attn, n, None) for n in (*names, "norm_added_q", "norm_added_k")]
    return [p for m in modules if m is not None for p in m.parameters() if p.requires_grad]


def _joint_qkv(
    attn: Attention, image: Any, text: torch.Tensor | None, modulation: Any = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v of the image and text tokens concatenated in the projections' layout, handed over as the kernel's
    `(batch, heads, tokens, head_dim)` views; the image tokens modulated first when `modulation` is given."""
    if modulation is not None:
        image = _modulate(image, modulation)
    query, key, value = _heads(attn, image, attn.to_q, attn.to_k, attn.to_v, attn.norm_q, attn.norm_k)
    if text is not None:
        projections = (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj, attn.norm_added_q, attn.norm_added_k)
        text_qkv = _heads(attn, text, *projections)
        query, key, value = (torch.cat([a, b], dim=1) for a, b in zip((query, key, value), text_qkv))
    return query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)


def _modulate(x: torch.Tensor, modulation: tuple[nn.Module, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """`AdaLayerNormZero`'s output from its input: `norm(x) * (1 + scale[:, None]) + shift[:, None]`."""
    norm, scale, shift = modulation
    return norm(x) * (1 + scale[:, None]) + shift[:, None]


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


def lean_joint_attention(model: nn.Module, recompute_qkv: bool = True) -> int:
    """Give every attention of `model` that runs diffusers' `JointAttnProcessor2_0` (exactly that class) the lean
    processor (`recompute_qkv`: q, k, v projected again in backward, on CPU); returns how many. Call before
    `fully_shard`."""
    count = 0
    for module in model.modules():
        if isinstance(module, Attention) and type(module.processor) is JointAttnProcessor2_0:
            module.set_processor(LeanJointAttnProcessor(recompute_qkv))
            count += 1
    return count
