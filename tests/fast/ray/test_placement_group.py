"""Hybrid sharding's groups across nodes: which shard groups span nodes, a warning naming them, refused with
--fsdp-strict-shard-groups."""

from __future__ import annotations

import logging

import pytest

from miles.ray.placement_group import check_shard_groups, shard_groups_across_nodes
from tests.fast.ray.test_colocation import where


def test_a_shard_group_across_nodes_warns_and_is_refused_with_the_strict_flag(caplog):
    ranks = where("0", "1", node="a") + where("0", node="b") + where("1", node="b")  # 4 ranks on 2 nodes
    assert shard_groups_across_nodes(ranks, 2) == []  # 2 x 2: each group on one node
    assert shard_groups_across_nodes(ranks, 4) == [(0, ["a", "b"])]
    mixed = where("0", "1", node="a") + where("0", node="b") + where("2", node="a")
    assert shard_groups_across_nodes(mixed, 2) == [(1, ["b", "a"])]
    placement = {"actor": ranks, "engines": where("0", node="a") + where("0", node="b")}
    check_shard_groups(None, placement, strict=True)  # no hybrid sharding: nothing to check
    check_shard_groups(2, placement, strict=True)
    with caplog.at_level(logging.WARNING, logger="miles.ray.placement_group"):
        check_shard_groups(4, placement, strict=False)
    assert "actor ranks 0-3 on nodes a, b" in caplog.text and "--fsdp-strict-shard-groups" in caplog.text
    with pytest.raises(ValueError, match="refused: --fsdp-strict-shard-groups"):
        check_shard_groups(4, placement, strict=True)
