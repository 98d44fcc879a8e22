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
