"""Train pairs: their count (every column agreeing), slices that are views, and the dealing to data-parallel ranks
with each row's index in the batch."""

from __future__ import annotations

import pytest
import torch

from miles.utils.types import PAIR_INDEX, num_pairs, shard_pairs, slice_pairs


def test_the_count_needs_every_column_to_agree():
    assert num_pairs({}) == 0
    assert num_pairs({"a": torch.zeros(3, 2), "b": torch.zeros(3)}) == 3
    with pytest.raises(ValueError, match="train pair columns disagree in length"):
        num_pairs({"a": torch.zeros(3), "b": torch.zeros(2)})


def test_a_slice_is_a_view_of_the_pairs():
    pairs = {"a": torch.arange(6.0)}
    part = slice_pairs(pairs, 2, 4)
    part["a"].zero_()  # a hook writing into its slice
    assert pairs["a"].tolist() == [0, 1, 0, 0, 4, 5]


def test_ranks_are_dealt_every_dp_size_th_row_with_its_index_as_copies():
    pairs = {"a": torch.arange(6) * 10}
    shards = shard_pairs(pairs, 2)
    assert [s["a"].tolist() for s in shards] == [[0, 20, 40], [10, 30, 50]]
    assert [s[PAIR_INDEX].tolist() for s in shards] == [[0, 2, 4], [1, 3, 5]]
    shards[0]["a"].zero_()
    assert pairs["a"][0] == 0 and pairs["a"][2] == 20  # the shards are copies
    with pytest.raises(ValueError, match="6 train pairs cannot be split evenly over 4 data-parallel ranks"):
        shard_pairs(pairs, 4)
