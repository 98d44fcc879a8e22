"""FSDP2 on gloo (CPU) ranks: what FSDP2 keeps gathered to overlap work on CUDA streams, which nothing overlaps on CPU.

`apply_fsdp2` calls `gather_one_group_at_a_time` on CPU ranks. Without streams, FSDP2's overlap buffers only hold
memory: in backward it would prefetch the next group beside the current one (`no_backward_prefetch`), and in forward
it keeps each group's flat all-gather buffer (the whole group, once more beside its gathered parameters) until the
next group has copied its own out (`free_gathers_after_copy_out`). The values gathered and computed are the same.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule


def gather_one_group_at_a_time(model: nn.Module) -> None:
    """Both of the module docstring's changes, on every FSDP2 group of `model` (after `fully_shard`)."""
    no_backward_prefetch(model)
    free_gathers_after_copy_out(model)


def no_backward_prefetch(model: nn.Module) -> None:
    """No FSDP2 group of `model` gathers the next group's parameters ahead in backward (FSDP2 prefetches one by
    default, which overlaps on CUDA streams only): each names itself as the one to prefetch, already gathered when
    its backward starts, which replaces the default and gathers nothing more."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_modules_to_backward_prefetch([module])


def free_gathers_after_copy_out(model: nn.Module) -> None:
    """Each FSDP2 group of `model` frees its flat all-gather buffer once its parameters are copied out of it, in
    forward too: FSDP2 keeps it (`all_gather_state`) until the next group's copy-out so that, on CUDA, the next
    all-gather may overlap this copy-out; on CPU it only holds the group twice while the group computes (64 MiB for
    a 1024-wide SD3 block's MLP). A forward pre-hook after FSDP2's own (which gathers and copies out)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.register_forward_pre_hook(_free_kept_gather)


def _free_kept_gather(module: Any, args: Any) -> None:
    state = module._get_fsdp_state()  # the root's communication context, shared by every group of the model
    state._comm_ctx.all_gather_state = None  # what FSDP2 itself does after the next copy-out, without a stream wait
