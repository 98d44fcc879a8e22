"""Frozen GELU MLPs that keep their input for backward instead of their hidden activation.

A LoRA network's blocks end in diffusers' `FeedForward` (`Linear -> GELU -> Dropout(0) -> Linear`) with frozen
weights. Autograd keeps the GELU's input for backward: the MLP's hidden activation, 4x the model width, the largest
tensor a LoRA block saves (16 of 48 MiB per 1024-wide SD3 block at 1024 image tokens in fp32; 36% of the saved
bytes). With the weights frozen nothing else of the MLP is saved: backward needs the weights, not the activations,
except the GELU's input. `lean_frozen_mlps` makes each such MLP keep its input instead (a quarter of the size) and
recompute the hidden activation in backward with the same first linear; the gradients are then computed by the same
operations autograd runs (`mm` of the incoming gradient with each weight, `gelu_backward`), so they are bit-identical
(`tests/fast/backends/fsdp_utils/test_frozen_mlp.py`). The cost is that first linear again in backward, a quarter
of a block's forward matmuls. With nothing of the hidden activation kept, the GELU is computed in place in forward
and its gradient in place in backward (the same kernels): one 4x-wide tensor at a time at the trainer's peak.

In SD3's joint blocks the MLP's input is itself a LayerNorm of the residual stream, modulated (`norm2(x) * (1 +
scale) + shift`), and the norm keeps the stream for its own backward: `lean_frozen_mlps` also gives each
`JointTransformerBlock` a forward that hands its lean MLPs the stream and the modulation (`_lean_block_forward`, the
same operations in the same order), and the MLP keeps only the stream (`_FrozenModulatedGeluMlp`), recomputing the
norm and the modulation in backward (elementwise work, a few operations per element; 4.4 of a 1024-wide block's
35.6 MiB at 1133 tokens no longer kept), with the gradients of the operations autograd runs. With the lean joint
attention (`joint_attention.py`) the block does the same for the attention: `norm1` returns its input and the
modulation (`_unmodulated_norm_forward`), which the attention applies itself.

Only where it saves and changes nothing: the MLP's parameters are all frozen and its input requires grad (under
`torch.no_grad`, or in a fully trained MLP, the module's own forward runs); its dropouts have p = 0; its activation is
diffusers' `GELU` over a plain `nn.Linear` (a LoRA-wrapped or GEGLU MLP keeps its own forward). `apply_fsdp2` installs
it before sharding, not with activation checkpointing (the block recomputes its MLP already) nor with `--compile`.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

LEAN_MARK = "_miles_lean_mlp"  # set on each MLP that got the lean forward


class _FrozenGeluMlp(torch.autograd.Function):
    """`Linear -> GELU -> Linear` with frozen weights: saves the input (and the weights, as `F.linear` would); the
    backward recomputes the GELU's input with the same `F.linear` and computes the input's gradient as autograd's
    `AddmmBackward0` / `MmBackward0` and `GeluBackward0` do."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, first: nn.Linear, approximate: str, last: nn.Linear) -> torch.Tensor:
        hidden = _gelu_in_place(F.linear(x, first.weight, first.bias), approximate)
        ctx.save_for_backward(x, first.weight, first.bias, last.weight)
        ctx.approximate = approximate
        return F.linear(hidden, last.weight, last.bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        x, w1, b1, w2 = ctx.saved_tensors
        return _mlp_input_grad(grad, x, w1, b1, w2, ctx.approximate), None, None, None


class _FrozenModulatedGeluMlp(torch.autograd.Function):
    """`_FrozenGeluMlp` of `norm(x) * (1 + scale[:, None]) + shift[:, None]` (SD3's joint block before its MLP), keeping
    `x` (the residual stream, which the norm kept anyway) instead of the modulated input as well: backward recomputes
    the norm (its mean and rstd too) and the modulation, then runs the MLP's backward, the modulation's
    (`MulBackward0`: the gradient times `1 + scale`) and the norm's (`native_layer_norm_backward`), as autograd does.
    `scale` and `shift` take no gradient (the caller checks)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, norm: nn.LayerNorm, *mlp: Any):
        first, approximate, last = mlp
        modulated = norm(x) * (1 + scale[:, None]) + shift[:, None]
        hidden = F.linear(modulated, first.weight, first.bias)
        del modulated  # nothing keeps it: freed before the GELU
        hidden = _gelu_in_place(hidden, approximate)
        ctx.norm, ctx.approximate = norm, approximate
        ctx.save_for_backward(x, scale, shift, first.weight, first.bias, last.weight)
        return F.linear(hidden, last.weight, last.bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, scale, shift, w1, b1, w2 = ctx.saved_tensors
        norm = ctx.norm
        normed, mean, rstd = torch.native_layer_norm(x, norm.normalized_shape, None, None, norm.eps)
        factor = 1 + scale[:, None]
        # the modulation written over the norm's output (the forward's two kernels, out of place there): one
        # stream-sized tensor less, and the list hands it over so that it is freed once the GELU input is recomputed
        modulated = [normed.mul_(factor).add_(shift[:, None])]
        del normed
        grad_modulated = _mlp_input_grad(grad, modulated, w1, b1, w2, ctx.approximate)
        grad_normed = grad_modulated * factor
        mask = [True, False, False]
        grad_x = torch.ops.aten.native_layer_norm_backward(
            grad_normed, x, norm.normalized_shape, mean, rstd, None, None, mask
        )[0]
        return grad_x, None, None, None, None, None, None


def _gelu_in_place(hidden: torch.Tensor, approximate: str) -> torch.Tensor:
    """`F.gelu(hidden)` written over `hidden` (the same kernel, in place): the forward holds one 4x-wide tensor at a
    time instead of the GELU's input beside its output. Only for a `hidden` nothing else reads (no autograd here)."""
    return torch.ops.aten.gelu_(hidden, approximate=approximate)


def _mlp_input_grad(
    grad: torch.Tensor,
    x: torch.Tensor | list[torch.Tensor],
    w1: torch.Tensor,
    b1: torch.Tensor,
    w2: torch.Tensor,
    approximate: str,
) -> torch.Tensor:
    """The input's gradient of `Linear -> GELU -> Linear` (frozen) at `x`, as autograd computes it; the GELU's
    gradient is written over its (recomputed) input, which nothing reads after it (the same elementwise kernel, one
    4x-wide tensor less at once). `x` in a one-element list is a temporary of the caller's: taken out of the list,
    it is freed once the GELU input is recomputed, before the gradients' 4x-wide tensors exist."""
    if isinstance(x, list):
        x = x.pop()
    shape = x.shape
    hidden_in = F.linear(x, w1, b1)  # the forward's GELU input, recomputed by the same kernel
    del x
    grad_hidden = _linear_input_grad(grad, w2, hidden_in.shape)
    gelu_backward = torch.ops.aten.gelu_backward.grad_input
    grad_hidden = gelu_backward(grad_hidden, hidden_in, approximate=approximate, grad_input=hidden_in)
    return _linear_input_grad(grad_hidden, w1, shape)


def _linear_input_grad(grad: torch.Tensor, weight: torch.Tensor, input_shape: torch.Size) -> torch.Tensor:
    """The input's gradient of `F.linear(input, weight, bias)` as autograd computes it for a frozen `weight`: the
    forward ran `addmm(bias, input.view(-1, in), weight.t())` (or `mm`), whose backward is `grad.mm(weight.t().t())`
    on the gradient reshaped to rows (`mm_mat1_backward` for a row-major input), viewed back to the input's shape."""
    return grad.reshape(-1, grad.shape[-1]).mm(weight).view(input_shape)


def _is_lean_candidate(mlp: nn.Module) -> bool:
    """diffusers' `FeedForward` as `[GELU(Linear), Dropout(0), Linear(, Dropout(0))]`: what `_FrozenGeluMlp` computes."""
    from diffusers.models.activations import GELU
    from diffusers.models.attention import FeedForward

    if type(mlp) is not FeedForward or len(mlp.net) not in (3, 4):
        return False
    act, *rest = mlp.net
    dropouts = [rest[0], *rest[2:]]
    return (
        type(act) is GELU
        and type(act.proj) is nn.Linear
        and type(rest[1]) is nn.Linear
        and all(type(d) is nn.Dropout and d.p == 0.0 for d in dropouts)
    )


def _lean_forward(mlp: Any, original: Any, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """The MLP's forward: `_FrozenGeluMlp` where it saves memory and computes the same, the module's own otherwise.
    With `modulation=(norm, scale, shift)` (from `_lean_block_forward`) its input is `norm(hidden_states) * (1 +
    scale[:, None]) + shift[:, None]`, computed inside `_FrozenModulatedGeluMlp` where that keeps less."""
    frozen = not any(p.requires_grad for p in mlp.parameters())
    lean = frozen and torch.is_grad_enabled() and hidden_states.requires_grad
    act, last = mlp.net[0], mlp.net[2]
    if "modulation" in kwargs:
        norm, scale, shift = kwargs.pop("modulation")
        plain_norm = type(norm) is nn.LayerNorm and norm.weight is None and norm.bias is None
        if lean and plain_norm and not (args or kwargs or scale.requires_grad or shift.requires_grad):
            return _FrozenModulatedGeluMlp.apply(hidden_states, scale, shift, norm, act.proj, act.approximate, last)
        hidden_states = norm(hidden_states) * (1 + scale[:, None]) + shift[:, None]
        lean = lean and hidden_states.requires_grad
    if args or kwargs or not lean:
        return original(hidden_states, *args, **kwargs)
    return _FrozenGeluMlp.apply(hidden_states, act.proj, act.approximate, last)


def _lean_block_forward(
    block: Any,
    original: Any,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    joint_attention_kwargs: dict[str, Any] | None = None,
) -> Any:
    """diffusers' `JointTransformerBlock.forward` (SD3), the same operations in the same order, except that each
    lean MLP gets the residual stream and its modulation rather than the modulated stream (`_lean_forward`). SD3.5's
    dual-attention blocks and chunked feed-forwards run diffusers' forward."""
    if block.use_dual_attention or block._chunk_size is not None:
        return original(hidden_states, encoder_hidden_states, temb, joint_attention_kwargs)
    attn_kwargs = dict(joint_attention_kwargs or {})
    if getattr(block.norm1, LEAN_MARK, False) and getattr(block.attn.processor, "recompute_qkv", False):
        norm_hidden_states, modulation, gate_msa, shift_mlp, scale_mlp, gate_mlp = block.norm1(
            hidden_states, emb=temb, unmodulated=True
        )  # the stream and its modulation, applied inside the attention (`joint_attention.py`)
        attn_kwargs["modulation"] = modulation
    else:
        norm_hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp = block.norm1(hidden_states, emb=temb)
    if block.context_pre_only:
        norm_encoder_hidden_states = block.norm1_context(encoder_hidden_states, temb)
    else:
        norm_encoder_hidden_states, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = block.norm1_context(
            encoder_hidden_states, emb=temb
        )
    attn_output, context_attn_output = block.attn(
        hidden_states=norm_hidden_states,
        encoder_hidden_states=norm_encoder_hidden_states,
        **attn_kwargs,
    )
    hidden_states = hidden_states + gate_msa.unsqueeze(1) * attn_output
    ff_output = _modulated_mlp(block.ff, block.norm2, hidden_states, scale_mlp, shift_mlp)
    hidden_states = hidden_states + gate_mlp.unsqueeze(1) * ff_output
    if block.context_pre_only:
        return None, hidden_states
    encoder_hidden_states = encoder_hidden_states + c_gate_msa.unsqueeze(1) * context_attn_output
    context_ff = _modulated_mlp(block.ff_context, block.norm2_context, encoder_hidden_states, c_scale_mlp, c_shift_mlp)
    return encoder_hidden_states + c_gate_mlp.unsqueeze(1) * context_ff, hidden_states


def _unmodulated_norm_forward(
    norm1: Any,
    original: Any,
    x: torch.Tensor,
    timestep: torch.Tensor | None = None,
    class_labels: torch.Tensor | None = None,
    hidden_dtype: torch.dtype | None = None,
    emb: torch.Tensor | None = None,
    unmodulated: bool = False,
) -> Any:
    """diffusers' `AdaLayerNormZero.forward`; with `unmodulated` its input and `(norm, scale_msa, shift_msa)` in place
    of `norm(x) * (1 + scale_msa[:, None]) + shift_msa[:, None]`, which the lean joint attention computes itself."""
    if not unmodulated:
        return original(x, timestep, class_labels, hidden_dtype, emb)
    if norm1.emb is not None:
        emb = norm1.emb(timestep, class_labels, hidden_dtype=hidden_dtype)
    emb = norm1.linear(norm1.silu(emb))
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = emb.chunk(6, dim=1)
    return x, (norm1.norm, scale_msa, shift_msa), gate_msa, shift_mlp, scale_mlp, gate_mlp


def _modulated_mlp(mlp: nn.Module, norm: nn.Module, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> Any:
    if getattr(mlp, LEAN_MARK, False):
        return mlp(x, modulation=(norm, scale, shift))
    return mlp(norm(x) * (1 + scale[:, None]) + shift[:, None])


def lean_frozen_mlps(model: nn.Module) -> int:
    """Give every frozen-GELU-MLP candidate of `model` the lean forward (see the module's docstring), and SD3's joint
    blocks the forward that hands those MLPs their un-normalised input (`_lean_block_forward`); returns how many
    MLPs. Call before `fully_shard` (FSDP2's hooks then run around it). Idempotent."""
    from diffusers.models.attention import JointTransformerBlock
    from diffusers.models.normalization import AdaLayerNormZero

    count = 0
    for module in model.modules():
        if getattr(module, LEAN_MARK, False):
            continue
        if _is_lean_candidate(module):
            module.forward = functools.partial(_lean_forward, module, module.forward)
            setattr(module, LEAN_MARK, True)
            count += 1
        elif type(module) is JointTransformerBlock:
            module.forward = functools.partial(_lean_block_forward, module, module.forward)  # type: ignore[method-assign]
            setattr(module, LEAN_MARK, True)
            if type(module.norm1) is AdaLayerNormZero and not getattr(module.norm1, LEAN_MARK, False):
                norm1 = module.norm1
                norm1.forward = functools.partial(_unmodulated_norm_forward, norm1, norm1.forward)
                setattr(norm1, LEAN_MARK, True)
    return count
