"""The trainer's end of the weight sync: the plan of what it sends (the kept entries, in the dtypes they are sent
in), which rank checksums each tensor of a direct push, a push on one rank that an engine receives bit for bit, and
(from the gloo ranks' background job) every rank writing its own rows of uneven shards into the shared buckets."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from miles.backends.fsdp_utils.weight_push import WeightPusher, checksum_owners, sync_plan
from miles.utils.distributed import find_free_port
from miles.utils.weight_checksum import block_terms
from miles.weight_sync.protocol import plan_buckets
from miles.weight_sync.receiver import receive_into
from miles.weight_sync.transports import Transport, TransportSpec
from tests.fast.backends.fsdp_utils import rank_jobs
from tests.fast.backends.fsdp_utils.gather_plan_workers import is_lora

# the test that reads its reports (the `gloo_reports` fixture of conftest.py) starts the job
ON_GLOO = pytest.mark.background(rank_jobs.SCRIPT, rank_jobs.GATHER_JOB)


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.proj = nn.Linear(8, 6)
        self.norm = nn.LayerNorm(6)
        self.register_buffer("steps", torch.arange(3))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=generator))


def test_the_plan_holds_the_kept_entries_in_the_dtypes_they_are_sent_in():
    plan = sync_plan(
        Small(), 1 << 20, keep=lambda n: n != "norm.bias", as_dtype=lambda n: None if "norm" in n else torch.bfloat16
    )
    slots = {t.name: (t.shape, t.dtype) for b in plan.buckets for t in b.tensors}
    assert slots == {
        "steps": ((3,), "int64"),  # not floating: never cast
        "proj.weight": ((6, 8), "bfloat16"),
        "proj.bias": ((6,), "bfloat16"),
        "norm.weight": ((6,), "float32"),
    }
    assert plan.names == ["steps", "proj.weight", "proj.bias", "norm.weight"]  # the state dict's order


def test_each_tensor_is_checksummed_by_the_rank_with_the_fewest_bytes_so_far():
    plan = plan_buckets([("a", (100,), torch.float32), ("b", (10,), torch.float32), ("c", (60,), torch.float32),
                         ("d", (50,), torch.float32)], bucket_bytes=1 << 20)  # fmt: skip
    # largest first: a (400 B) -> rank 0; c (240) -> 1; d (200) -> 1 (240 < 400); b (40) -> 0 (400 < 440)
    assert checksum_owners(plan, 2) == [[0, 0, 1, 1]]
    assert checksum_owners(plan, 1) == [[0, 0, 0, 0]]
    assert checksum_owners(plan, 4) == [[0, 3, 1, 2]]
    two = plan_buckets([("a", (100,), torch.float32), ("b", (100,), torch.float32)], bucket_bytes=400)
    assert checksum_owners(two, 2) == [[0], [0]]  # each bucket is balanced on its own


def test_a_push_on_one_rank_hands_the_engine_every_tensor_bit_for_bit(world_of_one):
    model = Small()
    as_dtype = lambda name: None if "norm" in name else torch.bfloat16  # noqa: E731 - the engines' dtype
    pusher = WeightPusher(sync_plan(model, 64, as_dtype=as_dtype), 0, torch.device("cpu"))
    assert len(pusher.plan.buckets) == 5  # a bucket per tensor: the slots are reused
    with pytest.raises(RuntimeError, match=r"push before the weight sync was opened \(`open` on rank 0\)"):
        pusher.push(model, as_dtype=as_dtype)
    opener = pusher.prepare("shm")
    spec = TransportSpec("shm", "127.0.0.1", find_free_port(), 2, pusher.plan.buffer_bytes, 60.0, opener)
    state = model.state_dict()
    target = {n: torch.zeros(t.shape, dtype=as_dtype(n) or t.dtype) for n, t in state.items()}
    errors = []

    def engine():
        try:
            receive_into(Transport(spec, 1, torch.device("cpu")), pusher.plan, target, version=1)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=engine)
    thread.start()
    pusher.open(spec)
    assert pusher.push(model, as_dtype=as_dtype) > 0
    thread.join(60)
    pusher.close()
    assert errors == [] and not thread.is_alive()
    for name, value in state.items():
        expected = value.to(as_dtype(name) or value.dtype)
        assert target[name].dtype == expected.dtype and torch.equal(target[name], expected), name
        assert torch.equal(block_terms(target[name]), block_terms(expected))


@ON_GLOO
@pytest.mark.parametrize("run", ["ws6-shard3"])
def test_ranks_writing_their_own_rows_into_the_shared_buckets_give_the_full_tensors(gloo_reports, run):
    """The weight sync on one host (`WeightPusher.push_direct`): every rank of replica 0 writes its uneven dim-0 rows
    of each tensor, cast to the engines' dtype, where they lie in the bucket, rank 0 the buffer; what each of two
    syncs hands over (through two reused slots, then two resident: the whole sync in the file) is `full_tensor()`
    cast, bit for bit, with its `block_terms`."""
    reports = gloo_reports[run]
    expected = {n: t if is_lora(n) else t.to(torch.bfloat16) for n, t in reports[0]["per_tensor"].items()}
    assert all(report["direct"] is None for report in reports[1:]) and len(reports[0]["direct"]) == 4
    for sent in reports[0]["direct"]:
        assert list(sent) == list(expected)
        for name, value in expected.items():
            got, terms = sent[name]
            assert got.dtype == value.dtype and torch.equal(got, value), name
            assert torch.equal(terms, block_terms(value)), name
