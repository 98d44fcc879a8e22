"""What a trainer rank holds gathered at once (docs/user-guide/memory.md, a trainer rank's peak): `split_blocks`
groups a block's children, and on gloo no group prefetches the next one's gather in backward nor keeps its flat
all-gather buffer beside its gathered parameters in forward. One process, a fake
process group of two ranks (collectives do nothing, so only which groups are gathered is checked here; the values
under `split_blocks` are compared on real gloo ranks in test_fsdp.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
from torch.testing._internal.distributed.fake_pg import FakeStore

from miles.backends.fsdp_utils.fsdp import apply_fsdp2

WIDTH = 16


class Block(nn.Module):
    """A frozen base of two children with parameters and one without, and a trained adapter on one of them."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(WIDTH, WIDTH)
        self.act = nn.Tanh()
        self.ff = nn.Linear(WIDTH, WIDTH)
        self.adapter = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.act(self.attn(x)) + self.adapter(x)
        return x + self.ff(x)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@contextmanager
def fake_world_of_two() -> Iterator[None]:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield
    finally:
        dist.destroy_process_group()


def sharded(split_blocks: bool, checkpointing: bool = False) -> Net:
    torch.manual_seed(0)
    net = Net()
    for name, param in net.named_parameters():
        param.requires_grad_("adapter" in name)  # LoRA: only the adapter trains
    dtypes = {"param_dtype": torch.float32, "reduce_dtype": torch.float32}
    return apply_fsdp2(net, list(net.blocks), **dtypes, split_blocks=split_blocks, gradient_checkpointing=checkpointing)


def gathered_in_backward(net: Net, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """At each gather in backward: the elements of the blocks' parameters gathered or being gathered (the root's
    aside)."""
    groups = [m._get_fsdp_state()._fsdp_param_group for m in net.modules() if isinstance(m, FSDPModule)]
    blocks = [g for g in groups if g is not None and g is not net._get_fsdp_state()._fsdp_param_group]
    seen: list[int] = []
    unshard = FSDPParamGroup.unshard

    def counting(group: FSDPParamGroup, *args, **kwargs):
        unshard(group, *args, **kwargs)
        if torch._C._current_graph_task_id() != -1:  # inside backward
            held = [g for g in blocks if g.is_unsharded or g._all_gather_result is not None]
            seen.append(sum(p.sharded_size.numel() * 2 for g in held for p in g.fsdp_params))

    monkeypatch.setattr(FSDPParamGroup, "unshard", counting)
    net(torch.ones(2, WIDTH)).sum().backward()
    return seen


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("split_blocks", [False, True])
def test_one_group_is_gathered_at_a_time_in_backward(split_blocks, checkpointing, monkeypatch):
    """Also where activation checkpointing recomputes a block in backward: its children are freed after their
    recomputed forward and gathered again one at a time for their backward."""
    with fake_world_of_two():
        net = sharded(split_blocks, checkpointing)
        block = net.blocks[0]
        assert isinstance(block.attn, FSDPModule) == isinstance(block.ff, FSDPModule) == split_blocks
        assert not isinstance(block.act, FSDPModule)  # no parameters: no group
        # the names the checkpoints and the weight sync see do not change
        assert [n for n, _ in net.named_parameters()] == [n for n, _ in Net().named_parameters()]
        gathered = gathered_in_backward(net, monkeypatch)
    child, block = WIDTH * WIDTH + WIDTH, 3 * WIDTH * WIDTH + 2 * WIDTH
    if not split_blocks:
        assert max(gathered) == block  # never a second block beside it (FSDP2's prefetch)
    elif not checkpointing:
        assert max(gathered) == child  # never a second child beside it
    else:  # the child whose backward started the recompute beside the one recomputed, never the whole block
        assert max(gathered) == 2 * child


def test_backward_prefetch_is_left_to_fsdp2_on_other_backends(monkeypatch):
    """The prefetch is turned off only where nothing overlaps it: FSDP2's default elsewhere (here: forced)."""
    monkeypatch.setattr("miles.backends.fsdp_utils.fsdp.collective_device", lambda: torch.device("cuda", 0))
    with fake_world_of_two():
        net = sharded(split_blocks=False)
        gathered = gathered_in_backward(net, monkeypatch)
    assert max(gathered) == 2 * (3 * WIDTH * WIDTH + 2 * WIDTH)  # a block and the one prefetched beside it


def flat_gathers_kept_in_forward(net: Net) -> list[bool]:
    """While each block child computes its forward: whether FSDP2 still holds a flat all-gather buffer."""
    kept: list[bool] = []
    for block in net.blocks:
        for child in (block.attn, block.ff):
            child.register_forward_hook(
                lambda *_: kept.append(net._get_fsdp_state()._comm_ctx.all_gather_state is not None)
            )
    net(torch.ones(2, WIDTH))
    return kept


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_on_gloo_a_group_frees_its_flat_gather_after_copying_it_out_in_forward(device, monkeypatch):
    """FSDP2 keeps it until the next group's copy-out (to overlap on CUDA streams): left so on other backends."""
    monkeypatch.setattr("miles.backends.fsdp_utils.fsdp.collective_device", lambda: torch.device(device))
    with fake_world_of_two():
        kept = flat_gathers_kept_in_forward(sharded(split_blocks=True))
    assert len(kept) == 6 and all(kept) == (device == "cuda") and any(kept) == (device == "cuda")
