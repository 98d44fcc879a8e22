"""The weight sync's bucket protocol and CPU transports in one process: rank 0 and two engines as threads of a gloo
sync group, each engine copying the buckets into its own tensors in place and verifying their checksums."""

from __future__ import annotations

import os

import pytest
import torch

from miles.ray.weight_sync import check_placement
from miles.utils.weight_checksum import BLOCK_WORDS, WeightSyncError, block_terms, block_terms_reference
from miles.weight_sync.protocol import ALIGN, plan_buckets
from miles.weight_sync.receiver import check_plan, receive_into
from miles.weight_sync.transports import Transport, TransportSpec, choose_transport, shm_path
from tests.fast.weight_sync.sync_helpers import plan_of, run_sync


def _weights() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(33, 7, generator=generator),
        "a.bias": torch.randn(7, generator=generator).to(torch.bfloat16),
        "scale": torch.tensor(1.5),  # 0-d
        "steps": torch.arange(5, dtype=torch.int64),
        "b.weight": torch.randn(64, 64, generator=generator),  # 16 KiB: a bucket of its own below
        "c.weight": torch.randn(3, 5, generator=generator).to(torch.float16),
    }


def test_plan_lays_tensors_aligned_in_order_and_gives_an_oversized_one_its_own_bucket():
    weights = _weights()
    plan = plan_buckets([(n, tuple(t.shape), t.dtype) for n, t in weights.items()], bucket_bytes=4096)
    layout = [[(t.name, t.offset) for t in b.tensors] for b in plan.buckets]
    # 33*7*4 = 924 bytes, then 14 -> 960 (aligned), 4 -> 1024, 40 -> 1088; 16 KiB alone; 30 bytes
    assert layout == [
        [("a.weight", 0), ("a.bias", 960), ("scale", 1024), ("steps", 1088)],
        [("b.weight", 0)],
        [("c.weight", 0)],
    ]
    assert [b.nbytes for b in plan.buckets] == [1128, 16384, 30]
    assert plan.buffer_bytes == 16384 and plan.total_bytes == 1128 + 16384 + 30
    assert all(t.offset % ALIGN == 0 for b in plan.buckets for t in b.tensors)
    assert plan.names == list(weights)


@pytest.mark.parametrize("name", list(_weights()))
def test_block_checksum_equals_the_plain_integer_sums_and_sees_a_bit_and_a_moved_block(name):
    tensor = _weights()[name]
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


def _sync(kind: str, weights: dict, targets: list[dict], corrupt: str | None = None, syncs: int = 2) -> list:
    """Rank 0 sends `weights` `syncs` times over `kind`; engine i receives into `targets[i]`. Returns each engine's
    errors."""
    plan = plan_of(weights)
    errors: list[list] = [[] for _ in targets]

    def engine(index: int):
        def take(spec: TransportSpec, rank: int) -> None:
            transport = Transport(spec, rank, torch.device("cpu"))
            for version in range(syncs):
                try:
                    receive_into(transport, plan, targets[index], version)
                except WeightSyncError as exc:
                    errors[index].append(exc)

        return take

    spec = run_sync(kind, weights, [engine(i) for i in range(len(targets))], syncs=syncs, corrupt=corrupt, plan=plan)
    if kind == "shm":
        assert not os.path.exists(spec.shm_path)  # unlinked once every member mapped it
    return errors


@pytest.mark.parametrize("kind", ["shm", "gloo"])
def test_engines_receive_every_bucket_into_their_tensors_in_place(kind):
    weights = _weights()
    targets = [{n: torch.zeros_like(t) for n, t in weights.items()} for _ in range(2)]
    pointers = [{n: t.data_ptr() for n, t in target.items()} for target in targets]
    errors = _sync(kind, weights, targets)
    assert errors == [[], []]
    for target, pointer in zip(targets, pointers):
        assert {n: t.data_ptr() for n, t in target.items()} == pointer  # copied in place
        for name, tensor in weights.items():
            assert target[name].dtype == tensor.dtype and torch.equal(target[name], tensor), name


def test_a_bit_flipped_in_transit_is_named_after_every_bucket_is_taken():
    weights = _weights()
    targets = [{n: torch.zeros_like(t) for n, t in weights.items()}]
    errors = _sync("shm", weights, targets, corrupt="b.weight", syncs=2)
    assert len(errors[0]) == 2  # both syncs ran to the end (the trainer was not left waiting) and both failed
    assert "1 of 1 tensors of bucket 1 differ" in str(errors[0][0]) and "first 'b.weight'" in str(errors[0][0])
    assert torch.equal(targets[0]["c.weight"], weights["c.weight"])  # the buckets after it were still taken


def test_a_plan_that_does_not_bind_the_engine_is_refused_before_any_sync():
    weights = _weights()
    plan = plan_of(weights)
    check_plan(plan, dict(weights), complete=True)
    with pytest.raises(WeightSyncError, match="no tensor for.*'steps'"):
        check_plan(plan, {n: t for n, t in weights.items() if n != "steps"}, complete=True)
    with pytest.raises(WeightSyncError, match="a.weight: the trainer sends shape \\(33, 7\\), the engine holds"):
        check_plan(plan, {**weights, "a.weight": torch.zeros(7, 33)}, complete=True)
    with pytest.raises(WeightSyncError, match="leaves 1 engine tensors unchanged"):
        check_plan(plan, {**weights, "extra": torch.zeros(1)}, complete=True)
    check_plan(plan, {**weights, "extra": torch.zeros(1)}, complete=False)  # LoRA: the base weights stay


def test_transport_follows_placement():
    rank0 = {"node_id": "n0", "gpus": ["0"]}
    on = [{"node_id": "n0", "gpus": ["0"]}, {"node_id": "n0", "gpus": ["0"]}]
    apart = [{"node_id": "n0", "gpus": ["1"]}, {"node_id": "n1", "gpus": ["0"]}]
    assert choose_transport(rank0, on, "cpu") == "shm"
    assert choose_transport(rank0, apart, "cpu") == "gloo"
    assert choose_transport(rank0, on, "cuda") == "cuda_ipc"
    assert choose_transport(rank0, apart, "cuda") == "nccl"
    assert choose_transport(rank0, [on[0], apart[0]], "cuda") == "gloo"  # NCCL cannot hold GPU 0 twice


def test_a_forced_shared_transport_that_some_engine_cannot_map_is_refused_naming_the_flag():
    rank0 = {"node_id": "n0", "gpus": ["0"]}
    check_placement("shm", rank0, [{"node_id": "n0", "gpus": []}])
    check_placement("gloo", rank0, [{"node_id": "n1", "gpus": []}])
    with pytest.raises(
        ValueError, match=r"--weight-sync-transport shm needs every engine on the node .* engines \[1\]"
    ):
        check_placement("shm", rank0, [{"node_id": "n0", "gpus": []}, {"node_id": "n1", "gpus": []}])
    with pytest.raises(ValueError, match=r"cuda_ipc needs every engine on the GPU"):
        check_placement("cuda_ipc", rank0, [{"node_id": "n0", "gpus": ["1"]}])


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
