"""The weight sync's CPU transports in one process: rank 0 and two engines as threads of a gloo sync group, each
engine copying the buckets into its own tensors in place; the block checksums the buckets carry, the transport a
placement picks, and a transport's cleanup. The bucket plan is tested in test_protocol.py, the engine's checks of
what it receives in test_receiver.py."""

from __future__ import annotations

import os

import pytest
import torch

from miles.utils.weight_checksum import (
    BLOCK_WORDS,
    WeightSyncError,
    block_terms,
    block_terms_range,
    block_terms_reference,
)
from miles.weight_sync.receiver import bind_resident, receive_into, unbind
from miles.weight_sync.transports import Transport, TransportSpec, choose_transport, shm_path
from tests.fast.weight_sync.sync_helpers import mixed_weights, plan_of, run_sync, sync_into


@pytest.mark.parametrize("name", list(mixed_weights()))
def test_block_checksum_equals_the_plain_integer_sums_and_sees_a_bit_and_a_moved_block(name):
    tensor = mixed_weights()[name]
    raw = tensor.contiguous().view(-1).view(torch.uint8)
    assert tuple(block_terms(tensor).tolist()) == block_terms_reference(raw.numpy().tobytes())
    flipped = raw.clone()
    flipped[-1] ^= 1
    assert not torch.equal(block_terms(flipped), block_terms(raw))


def test_block_checksum_sees_blocks_swapped_and_a_view_at_any_offset():
    words = torch.arange(3 * BLOCK_WORDS, dtype=torch.int64)
    swapped = torch.cat([words[BLOCK_WORDS : 2 * BLOCK_WORDS], words[:BLOCK_WORDS], words[2 * BLOCK_WORDS :]])
    plain, weighted = block_terms(words).tolist()
    assert block_terms(swapped).tolist()[0] == plain and block_terms(swapped).tolist()[1] != weighted
    odd = torch.arange(41, dtype=torch.int16)[1:]  # 2 bytes into its storage: not a view of 64-bit words
    assert tuple(block_terms(odd).tolist()) == block_terms_reference(odd.clone().view(torch.uint8).numpy().tobytes())


@pytest.mark.parametrize("total", [5, 8, 13, 520, 4100, 70_001])
def test_block_checksum_shares_of_word_aligned_ranges_sum_to_the_whole(total):
    """Each trainer rank checksums the bytes it writes (`block_terms_range`): any split on 64-bit words, a block's
    middle included, sums to the tensor's terms; a range that does not start on a word is refused."""
    raw = torch.randint(0, 256, (total,), dtype=torch.uint8, generator=torch.Generator().manual_seed(total))
    for cuts in ([0, total], [0, 8, total], [0, total // 8 * 8, total], [0, 264, 4096, total], [0, 512, 1000, total]):
        cuts = sorted({c for c in cuts if c <= total})
        shares = [block_terms_range(raw[a:b].clone(), a, total) for a, b in zip(cuts, cuts[1:])]
        assert torch.equal(torch.stack(shares).sum(dim=0), block_terms(raw)), cuts
    with pytest.raises(ValueError, match="do not lie on 64-bit words"):
        block_terms_range(raw[4:].clone(), 4, total)


@pytest.mark.parametrize("kind", ["shm", "gloo"])
def test_engines_receive_every_bucket_into_their_tensors_in_place(kind):
    weights = mixed_weights()
    targets = [{n: torch.zeros_like(t) for n, t in weights.items()} for _ in range(2)]
    pointers = [{n: t.data_ptr() for n, t in target.items()} for target in targets]
    errors = sync_into(kind, weights, targets)
    assert errors == [[], []]
    for target, pointer in zip(targets, pointers):
        assert {n: t.data_ptr() for n, t in target.items()} == pointer  # copied in place
        for name, tensor in weights.items():
            assert target[name].dtype == tensor.dtype and torch.equal(target[name], tensor), name


def test_resident_engines_share_one_copy_the_trainer_writes_and_split_its_verification():
    """Resident `shm`: each engine's tensors in the sent dtype become views of one shared file (the first engine's
    values copied in at binding), two syncs of different weights land in both engines without a copy, identical
    bytes in both; a tensor held in another dtype is still copied and verified by each engine."""
    first = mixed_weights()
    second = {n: (t + 1 if t.is_floating_point() else t * 3) for n, t in first.items()}
    targets = [{n: torch.zeros_like(t) for n, t in first.items()} for _ in range(2)]
    for target in targets:
        target["c.weight"] = torch.zeros(3, 5)  # held in fp32, sent in fp16: copied and cast
    bound: list = [None, None]
    assert sync_into("shm", [first, second], targets, resident=True, bound=bound) == [[], []]
    assert set(bound[0]) == set(bound[1]) == set(first) - {"c.weight"}
    for target, views in zip(targets, bound):  # each engine's tensors are its mapping of the file
        assert all(target[name].data_ptr() == view.data_ptr() for name, view in views.items())
    bound[0]["b.weight"][0, 0] = 7.0  # one copy: what one engine's mapping holds, the other's does
    assert targets[1]["b.weight"][0, 0] == 7.0
    bound[0]["b.weight"][0, 0] = second["b.weight"][0, 0]
    for target in targets:
        for name, tensor in second.items():
            assert torch.equal(target[name], tensor.to(target[name].dtype)), name


def test_resident_bit_flipped_after_the_checksum_is_named_by_the_engine_that_verifies_it():
    weights = mixed_weights()
    targets = [{n: torch.zeros_like(t) for n, t in weights.items()} for _ in range(2)]
    errors = sync_into("shm", weights, targets, corrupt="b.weight", resident=True)
    named = [e for engine in errors for e in engine]
    assert len(named) == 2 and all("first 'b.weight'" in str(e) for e in named)  # both syncs, one verifier each
    assert sorted(len(e) for e in errors) == [0, 2]  # the engines split the verification of the one copy


def test_resident_engine_whose_tensor_no_longer_views_the_shared_file_fails_the_next_sync():
    weights = mixed_weights()
    targets = [{n: t * 2 for n, t in weights.items()}]
    plan = plan_of(weights)

    def take(spec: TransportSpec, rank: int) -> None:
        transport = Transport(spec, rank, torch.device("cpu"))
        views = bind_resident(transport, plan, targets[0])
        assert all(torch.equal(targets[0][n], t * 2) for n, t in weights.items())  # its values until the sync
        receive_into(transport, plan, targets[0], 1, views)
        targets[0]["a.weight"].data = targets[0]["a.weight"].clone()  # e.g. a load that replaced the storage
        with pytest.raises(WeightSyncError, match=r"no longer are views of the shared weights, e.g. \['a.weight'\]"):
            receive_into(transport, plan, targets[0], 2, views)
        receive_into(transport, plan, targets[0], 2, {})  # the sync is still taken: the trainer does not wait

    run_sync("shm", weights, [take], syncs=2, plan=plan, resident=True)


def test_resident_tied_tensor_is_bound_under_its_first_name_and_copied_under_the_second():
    weights = {"w": torch.randn(16, 16), "head.w": None}
    weights["head.w"] = weights["w"]  # tied: one tensor under two names, sent twice
    tied = torch.zeros(16, 16)
    targets = [{"w": tied, "head.w": tied}]
    bound: list = [None]
    assert sync_into("shm", weights, targets, resident=True, bound=bound) == [[]]
    assert list(bound[0]) == ["w"] and torch.equal(tied, weights["w"])


def test_unbind_gives_each_bound_tensor_a_private_copy_of_its_values():
    shared = torch.arange(8, dtype=torch.float32)
    target = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
    target.data = shared[4:]
    assert unbind({"w": shared[4:]}, {"w": target}) == {}
    shared[4:] = -1.0  # the file changes: the engine's own load no longer sees it, nor writes it
    assert target.tolist() == [4.0, 5.0, 6.0, 7.0]


def test_transport_follows_placement():
    rank0 = {"node_id": "n0", "gpus": ["0"]}
    on = [{"node_id": "n0", "gpus": ["0"]}, {"node_id": "n0", "gpus": ["0"]}]
    apart = [{"node_id": "n0", "gpus": ["1"]}, {"node_id": "n1", "gpus": ["0"]}]
    assert choose_transport(rank0, on, "cpu") == "shm"
    assert choose_transport(rank0, apart, "cpu") == "gloo"
    assert choose_transport(rank0, on, "cuda") == "cuda_ipc"
    assert choose_transport(rank0, apart, "cuda") == "nccl"
    assert choose_transport(rank0, [on[0], apart[0]], "cuda") == "gloo"  # NCCL cannot hold GPU 0 twice


def test_buckets_larger_than_the_free_dev_shm_go_to_a_file_in_the_temporary_folder(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    assert shm_path(1 << 20).startswith("/dev/shm/") or not os.path.isdir("/dev/shm")
    assert shm_path(1 << 62).startswith(str(tmp_path))  # no tmpfs has 4 EiB free


def test_rank_0_leaves_a_sync_group_broken_by_a_dead_engine_without_raising_in_its_cleanup(caplog):
    class BrokenWork:  # what gloo's pending allreduce raises once an engine's process is gone
        def wait(self):
            raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:13699")

    transport = Transport.__new__(Transport)
    transport.rank, transport.kind, transport.buffer, transport.group = 0, "shm", torch.empty(8), object()
    transport.pending = {0: [BrokenWork()]}
    transport.close()  # the trainer's shutdown after the failed sync (which named the engine) goes on
    assert transport.pending == {} and transport.group is None
    assert "closed with a broken sync group" in caplog.text
