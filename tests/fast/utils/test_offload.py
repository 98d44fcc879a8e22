"""HostSwap (--colocate-sleep): storages freed while asleep, every tensor and view valid, bits back after a wake."""

import pytest
import torch

from miles.utils.offload import HOST_ALIGN, HostSwap, host_offsets


def test_sleep_frees_every_distinct_storage_once_and_wake_restores_the_bits():
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(64, generator=gen)
    view = base[8:24].view(4, 4)  # a view shares the storage: moved once
    other = torch.randn(3, 5, generator=gen, dtype=torch.float64)
    before = [base.clone(), view.clone(), other.clone()]
    swap = HostSwap(torch.device("cpu"))
    report = swap.sleep([base, view, other])
    assert report.storages == 2 and report.copied_bytes == 64 * 4 + 15 * 8 and report.discarded_bytes == 0
    assert base.untyped_storage().nbytes() == 0 and other.untyped_storage().nbytes() == 0
    assert swap.sleep([base]).storages == 0  # idempotent while asleep
    assert swap.wake().copied_bytes == report.copied_bytes
    for got, want in zip([base, view, other], before):
        assert torch.equal(got, want)
    view.mul_(2)  # the view still aliases its base after the round trip
    assert torch.equal(base[8:24], before[1].flatten() * 2)
    assert swap.wake().storages == 0  # a no-op when awake


def test_discarded_storages_are_freed_without_a_copy_unless_a_kept_tensor_shares_them():
    weights, shared, kept = torch.ones(10), torch.zeros(6), torch.full((4,), 3.0)
    shared_view = shared[:2]
    swap = HostSwap(torch.device("cpu"))
    report = swap.sleep([kept, shared_view], discard=[weights, shared])
    assert report.discarded_bytes == 40 and report.copied_bytes == 24 + 16
    assert weights.untyped_storage().nbytes() == 0
    swap.wake()
    assert weights.untyped_storage().nbytes() == 40  # reallocated; its values are the next load's to write
    assert torch.equal(shared, torch.zeros(6)) and torch.equal(kept, torch.full((4,), 3.0))


def test_one_host_buffer_per_actor_is_reused_across_cycles_and_values_follow_the_updates():
    x, y = torch.arange(8.0), torch.arange(100.0, 103.0, dtype=torch.float64)
    swap = HostSwap(torch.device("cpu"))
    swap.sleep([x, y])
    buffer = swap.host
    assert buffer.numel() == HOST_ALIGN + 3 * 8  # both storages in one buffer, each slice aligned, none padded
    swap.wake()
    x.add_(1)  # trained between cycles
    swap.sleep([x, y])
    assert swap.host is buffer
    swap.wake()
    assert torch.equal(x, torch.arange(8.0) + 1) and torch.equal(y, torch.arange(100.0, 103.0, dtype=torch.float64))
    big = torch.zeros(HOST_ALIGN)  # more bytes than the buffer holds: it grows
    swap.sleep([x, y, big])
    assert swap.host.numel() == 2 * HOST_ALIGN + 4 * HOST_ALIGN
    swap.wake()
    assert torch.equal(x, torch.arange(8.0) + 1) and not big.any()


def test_host_offsets_align_each_slice_and_size_the_buffer_to_the_last_byte():
    assert host_offsets([]) == ([], 0)
    assert host_offsets([1]) == ([0], 1)
    assert host_offsets([HOST_ALIGN, 1, HOST_ALIGN + 1, 3]) == (
        [0, HOST_ALIGN, 2 * HOST_ALIGN, 4 * HOST_ALIGN],
        4 * HOST_ALIGN + 3,
    )
    gib_tenth = 2**30 // 10  # 1.1 GiB in eleven pieces: exactly the bytes plus the alignment gaps, no power of two
    offsets, total = host_offsets([gib_tenth] * 11)
    assert total == 10 * (-(-gib_tenth // HOST_ALIGN) * HOST_ALIGN) + gib_tenth < 2**31


class RecordingPinner:
    """A mocked cudaHostRegister: which (pointer, size) are locked now, and every call in order."""

    def __init__(self):
        self.locked: dict[int, int] = {}
        self.calls: list[tuple[str, int]] = []

    def pin(self, data_ptr, nbytes):
        assert data_ptr not in self.locked
        self.locked[data_ptr] = nbytes
        self.calls.append(("pin", nbytes))

    def unpin(self, data_ptr):
        self.calls.append(("unpin", self.locked.pop(data_ptr)))


def test_the_host_buffer_is_locked_at_its_exact_size_and_a_replaced_one_is_unlocked_first():
    pinner = RecordingPinner()
    swap = HostSwap(torch.device("cpu"), pinner=pinner)
    small, big = torch.ones(3), torch.ones(1000)
    swap.sleep([small])
    assert swap.host.numel() == 12 and pinner.locked == {swap.host.data_ptr(): 12}
    swap.wake()
    swap.sleep([small, big])  # needs more: the 12-byte buffer is unlocked (and freed) before the larger one
    assert pinner.calls == [("pin", 12), ("unpin", 12), ("pin", HOST_ALIGN + 4000)]
    assert swap.host.numel() == HOST_ALIGN + 4000
    swap.wake()
    swap.sleep([big])  # fits: reused, no new lock
    swap.wake()
    assert len(pinner.calls) == 3 and torch.equal(big, torch.ones(1000)) and torch.equal(small, torch.ones(3))
    swap.release()
    assert pinner.locked == {} and swap.host is None


def test_release_while_asleep_is_refused_and_discard_only_sleeps_allocate_nothing():
    pinner = RecordingPinner()
    swap = HostSwap(torch.device("cpu"), pinner=pinner)
    x = torch.ones(4)
    swap.sleep([], discard=[x])
    assert swap.host is None and pinner.calls == []
    swap.wake()
    swap.sleep([x])
    with pytest.raises(RuntimeError, match="wake first"):
        swap.release()
    swap.wake()
    swap.release()
    assert pinner.locked == {}


def test_storages_that_cannot_be_resized_stay_in_place():
    mapped = torch.frombuffer(bytearray(torch.arange(6.0).numpy().tobytes()), dtype=torch.float32)
    assert not mapped.untyped_storage().resizable()  # as CPU weights memory-mapped from safetensors files
    swap = HostSwap(torch.device("cpu"))
    report = swap.sleep([mapped, torch.ones(2)])
    assert report.kept_bytes == 24 and report.storages == 1 and torch.equal(mapped, torch.arange(6.0))
    swap.wake()


def test_only_tensors_on_the_swap_device_move():
    x = torch.ones(4)
    swap = HostSwap(torch.device("meta"))
    assert swap.sleep([x]).storages == 0 and x.untyped_storage().nbytes() == 16


@pytest.mark.parametrize("flags", [("--async-rollout",), ("--debug-rollout-only",)])
def test_colocate_sleep_on_is_refused_where_the_phases_do_not_take_turns(flags, capsys):
    from miles.arguments.parser import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--loss-type", "nft", "--colocate-sleep", "on", *flags])
    assert f"--colocate-sleep on has the engines and the trainer ranks take turns on the GPU; {flags[0]}" in (
        capsys.readouterr().err
    )
    parse_args(["--loss-type", "nft", "--colocate-sleep", "auto", *flags])  # auto decides at start-up


def test_under_the_planners_fake_tensors_every_distinct_storage_sleeps_once():
    """A fake storage's data_ptr is 0: keyed by it, every storage of a plan's sleep was one (the last), and the plan's
    host_pinned_bytes_per_node counted that one alone (nft --colocate-sleep on the tiny model: 2.0 MB, not 11.7)."""
    from miles.plan.fake import PlanTensorMode

    with PlanTensorMode():
        base, other = torch.empty(64), torch.empty(3, 5, dtype=torch.float64)
        report = HostSwap(torch.device("cpu")).sleep([base, base[8:24], other])
    assert report.storages == 2 and report.copied_bytes == 64 * 4 + 15 * 8
