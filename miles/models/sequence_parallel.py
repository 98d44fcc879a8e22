"""Ulysses sequence parallelism's collectives (--sp-size): the process groups of consecutive ranks, the token split
before the first block, the all-to-alls that trade a sequence chunk of every head for the whole sequence of some heads
around attention, and the gather after the last block. Autograd-aware; gloo and NCCL alike (no reduce_scatter)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class SequenceParallelGroup:
    """This rank's sequence-parallel group: `size` consecutive ranks that run one sample's tokens together, this rank
    holding chunk `rank` (its rank within the group) of every token sequence between the first and last block."""

    group: dist.ProcessGroup
    size: int
    rank: int


def new_sequence_parallel_group(sp_size: int) -> SequenceParallelGroup | None:
    """The group of this rank: ranks [k·sp_size, (k + 1)·sp_size) for k = rank // sp_size; None at sp_size 1.

    Collective: every rank creates every group, in the same order (torch.distributed.new_group's contract)."""
    if sp_size == 1:
        return None
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % sp_size:
        raise ValueError(f"--sp-size {sp_size} must divide the trainer's world size {world} (--dp-size x --sp-size)")
    mine = None
    for first in range(0, world, sp_size):
        group = dist.new_group(list(range(first, first + sp_size)))
        if first <= rank < first + sp_size:
            mine = SequenceParallelGroup(group, sp_size, rank - first)
    return mine


def _exchange(x: torch.Tensor, sp: SequenceParallelGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """All-to-all: chunk i of `x` along `scatter_dim` goes to group rank i; what rank j sent comes j-th along
    `gather_dim`."""
    parts = torch.stack(x.chunk(sp.size, dim=scatter_dim)).contiguous()
    received = torch.empty_like(parts)
    dist.all_to_all_single(received, parts, group=sp.group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, sp: SequenceParallelGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        ctx.sp, ctx.dims = sp, (scatter_dim, gather_dim)
        return _exchange(x, sp, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        scatter_dim, gather_dim = ctx.dims
        return _exchange(grad, ctx.sp, gather_dim, scatter_dim), None, None, None  # the inverse exchange


def sequence_to_heads(x: torch.Tensor, sp: SequenceParallelGroup) -> torch.Tensor:
    """(B, S/N, H, Dh), this rank's tokens of every head -> (B, S, H/N, Dh), every token of this rank's heads."""
    return _AllToAll.apply(x, sp, 2, 1)


def heads_to_sequence(x: torch.Tensor, sp: SequenceParallelGroup) -> torch.Tensor:
    """The inverse of `sequence_to_heads`: (B, S, H/N, Dh) -> (B, S/N, H, Dh)."""
    return _AllToAll.apply(x, sp, 1, 2)


def split_sequence(x: torch.Tensor, sp: SequenceParallelGroup, dim: int = 1) -> torch.Tensor:
    """This rank's contiguous chunk of the tokens along `dim` (its backward leaves zeros on the other chunks)."""
    return x.chunk(sp.size, dim=dim)[sp.rank]


class _GatherSequence(torch.autograd.Function):
    """All-gather of the chunks. Every rank of the group computes the same loss from the gathered tokens, so the
    backward sums the full output's gradient over the group and keeps this rank's chunk: the group's ranks together
    then hold N times the gradient of the group's loss, which FSDP2's average over dp x sp ranks divides back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sp: SequenceParallelGroup, dim: int) -> torch.Tensor:
        ctx.sp, ctx.dim = sp, dim
        parts = [torch.empty_like(x) for _ in range(sp.size)]
        dist.all_gather(parts, x.contiguous(), group=sp.group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.sp.group)
        return total.chunk(ctx.sp.size, dim=ctx.dim)[ctx.sp.rank].contiguous(), None, None


def gather_sequence(x: torch.Tensor, sp: SequenceParallelGroup, dim: int = 1) -> torch.Tensor:
    """Every rank's chunk along `dim`, concatenated in group-rank order (the whole sequence on every rank)."""
    return _GatherSequence.apply(x, sp, dim)


def sequence_parallel_problems(
    family_name: str,
    sp_size: int,
    *,
    heads: int | dict[str, int],
    tokens: int | dict[str, int],
    supported: bool = True,
    supporting: str = "",
) -> list[str]:
    """Why `--sp-size sp_size` cannot split a transformer with `heads` attention heads over `tokens` tokens per sample
    (empty: it can). The flag's rules a family reports at start-up. A family of several attention kinds or token
    sequences names each: `heads` {"audio": 3, ...} reads "its 3 audio attention heads", `tokens` likewise; an
    unsupported family's refusal lists the families that do support it (`supporting`)."""
    if sp_size == 1:
        return []
    if not supported:
        return [
            f"--sp-size {sp_size}: the {family_name} family does not support sequence parallelism (only families "
            f"that declare supports_sequence_parallel do: {supporting or 'wan'}); use --sp-size 1"
        ]
    problems = []
    for kind, count in (heads if isinstance(heads, dict) else {"": heads}).items():
        if count % sp_size:
            problems.append(
                f"--sp-size {sp_size} must divide the transformer's {count} {kind + ' ' if kind else ''}attention "
                "heads (each rank attends with heads / sp-size of them); choose a divisor"
            )
    for kind, count in (tokens if isinstance(tokens, dict) else {"": tokens}).items():
        if count % sp_size:
            problems.append(
                f"--sp-size {sp_size} must divide the {count} {kind + ' ' if kind else ''}latent tokens per sample of "
                "this run's geometry (--resolution, --num-frames); choose a divisor or change the geometry"
            )
    return problems
