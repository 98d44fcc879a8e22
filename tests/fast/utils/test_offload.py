"""HostSwap (--colocate-sleep): storages freed while asleep, every tensor and view valid, bits back after a wake."""

import pytest
import torch

from miles.utils.offload import HOST_ALIGN, HostSwap


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
    assert buffer.numel() == 2 * HOST_ALIGN  # both storages in one buffer, each slice aligned
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
    from miles.utils.arguments import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--loss-type", "nft", "--colocate-sleep", "on", *flags])
    assert f"--colocate-sleep on has the engines and the trainer ranks take turns on the GPU; {flags[0]}" in (
        capsys.readouterr().err
    )
    parse_args(["--loss-type", "nft", "--colocate-sleep", "auto", *flags])  # auto decides at start-up
