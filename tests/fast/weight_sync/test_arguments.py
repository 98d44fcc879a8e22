"""The weight sync's flags as its parser group declares them: the transport's choices and default, the bucket size
in MiB (None: the device's default)."""

from __future__ import annotations

import argparse

import pytest

from miles.weight_sync.arguments import TRANSPORT_CHOICES, add_weight_sync_arguments


@pytest.fixture
def parser():
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_weight_sync_arguments(parser)
    return parser


def test_defaults_pick_the_transport_by_placement_and_the_bucket_by_device(parser):
    args = parser.parse_args([])
    assert (args.weight_sync_transport, args.weight_sync_bucket_mb) == ("auto", None)
    group = next(g for g in parser._action_groups if g.title.startswith("weight sync"))
    assert {a.dest for a in group._group_actions} == {"weight_sync_transport", "weight_sync_bucket_mb"}


def test_every_transport_is_a_choice_and_the_bucket_is_whole_mib(parser):
    for kind in TRANSPORT_CHOICES:
        assert parser.parse_args(["--weight-sync-transport", kind]).weight_sync_transport == kind
    assert set(TRANSPORT_CHOICES) == {"auto", "shm", "gloo", "cuda_ipc", "nccl"}
    assert parser.parse_args(["--weight-sync-bucket-mb", "128"]).weight_sync_bucket_mb == 128
    with pytest.raises(argparse.ArgumentError, match="invalid choice: 'rdma'"):
        parser.parse_args(["--weight-sync-transport", "rdma"])
    with pytest.raises(argparse.ArgumentError, match="invalid int value: '1.5'"):
        parser.parse_args(["--weight-sync-bucket-mb", "1.5"])


def test_a_cuda_transport_on_cpus_is_refused_at_parse_time_and_auto_on_a_cluster_is_left_to_the_connect(capsys):
    from miles.arguments.parser import parse_args
    from miles.weight_sync.arguments import transport_device_problem
    from tests.fast.arguments.test_parser import BASE, parse_error

    for kind in ("cuda_ipc", "nccl"):
        err = parse_error([*BASE, "--device", "cpu", "--weight-sync-transport", kind], capsys)
        assert (
            f"--weight-sync-transport {kind} moves CUDA buffers" in err and "give auto, shm (one host) or gloo" in err
        )
        assert transport_device_problem(kind, gpu=True) is None
    for kind in ("auto", "shm", "gloo"):
        assert transport_device_problem(kind, gpu=False) is None
        parse_args([*BASE, "--device", "cpu", "--weight-sync-transport", kind])
    # --device auto with --ray-address is the cluster's device, unknown here: `WeightSyncLink.connect` checks it
    parse_args([*BASE, "--ray-address", "10.0.0.1:6379", "--weight-sync-transport", "nccl"])
    parse_args([*BASE, "--device", "cuda", "--weight-sync-transport", "cuda_ipc"])
