"""The weight sync's CPU transports in one process: rank 0 and two engines as threads of a gloo sync group, each
engine copying the buckets into its own tensors in place; the block checksums the buckets carry, the transport a
placement picks, and a transport's cleanup. The bucket plan is tested in test_protocol.py, the engine's checks of
what it receives in test_receiver.py."""

from __future__ import annotations

import os

import pytest
import torch

from miles.utils.weight_checksum import BLOCK_WORDS, block_terms, block_terms_reference
from miles.weight_sync.transports import Transport, choose_transport, shm_path
from tests.fast.weight_sync.sync_helpers import mixed_weights, sync_into


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
