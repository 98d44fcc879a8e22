"""Frozen GELU MLPs that keep their input for backward instead of their hidden activation.

A LoRA network's blocks end in diffusers' `FeedForward` (`Linear -> GELU -> Dropout(0) -> Linear`) with frozen
weights. Autograd keeps the GELU's input for backward: the MLP's hidden activation, 4x the model width, the largest
tensor a LoRA block saves (16 of 48 MiB per 1024-wide SD3 block at 1024 image tokens in fp32; 36% of the saved
bytes). With the weights frozen nothing else of the MLP is saved: backward needs the weights, not the activations,
except the GELU's input. `lean_frozen_mlps` makes each such MLP keep its input instead (a quarter of the size) and
recompute the hidden activation in backward with the same first linear; the gradients are then computed by the same
operations autograd runs (`mm` of the incoming gradient with each weight, `gelu_backward`), so they are bit-identical
(`tests/fast/backends/fsdp_utils/test_frozen_mlp.py`). The cost is that first linear again in backward, a quarter
of a block's forward matmuls.

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
        hidden = F.gelu(F.linear(x, first.weight, first.bias), approximate=approximate)
        ctx.save_for_backward(x, first.weight, first.bias, last.weight)
        ctx.approximate = approximate
        return F.linear(hidden, last.weight, last.bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        x, w1, b1, w2 = ctx.saved_tensors
        hidden_in = F.linear(x, w1, b1)  # the forward's GELU input, recomputed by the same kernel
        grad_hidden = _linear_input_grad(grad, w2, hidden_in.shape)
        grad_hidden = torch.ops.aten.gelu_backward(grad_hidden, hidden_in, approximate=ctx.approximate)
        return _linear_input_grad(grad_hidden, w1, x.shape), None, None, None


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
    """The MLP's forward: `_FrozenGeluMlp` where it saves memory and computes the same, the module's own otherwise."""
    frozen = not any(p.requires_grad for p in mlp.parameters())
    if args or kwargs or not (frozen and torch.is_grad_enabled() and hidden_states.requires_grad):
        return original(hidden_states, *args, **kwargs)
    act, last = mlp.net[0], mlp.net[2]
    return _FrozenGeluMlp.apply(hidden_states, act.proj, act.approximate, last)


def lean_frozen_mlps(model: nn.Module) -> int:
    """Give every frozen-GELU-MLP candidate of `model` the lean forward (see the module's docstring); returns how
    many. Call before `fully_shard` (FSDP2's hooks then run around it). Idempotent."""
    count = 0
    for module in model.modules():
        if _is_lean_candidate(module) and not getattr(module, LEAN_MARK, False):
            module.forward = functools.partial(_lean_forward, module, module.forward)
            setattr(module, LEAN_MARK, True)
            count += 1
    return count
