"""Pair noise: a pair draws the same noise wherever its row lands (any batch, rank or micro-batch), fresh noise in
another window, rollout or stream, and the train pairs must carry their rows."""

import argparse
from types import MappingProxyType

import pytest
import torch

from miles.backends.fsdp_utils.loss_hub.noise import pair_generators, pair_noise
from miles.backends.fsdp_utils.loss_hub.types import DiffusionLossContext

SHAPE = torch.Size([1, 2, 3])


def ctx(rollout_id=4, seed=7):
    args = argparse.Namespace(seed=seed)
    return DiffusionLossContext(args, "actor", rollout_id, 0, 1, torch.device("cpu"), torch.float32, None, {})


def noise(rows, window=0, salt=0, **context):
    generators = pair_generators(ctx(**context), {"pair_index": torch.tensor(rows)}, window, salt)
    return pair_noise(generators, torch.Size([len(rows), *SHAPE[1:]]))


def test_a_pair_draws_its_noise_by_its_row_whatever_its_batch_mates():
    alone, mixed = noise([5]), noise([3, 5, 9])
    assert alone.shape == (1, 2, 3) and alone.dtype == torch.float32 and mixed.shape == (3, 2, 3)
    assert torch.equal(alone[0], mixed[1]) and torch.equal(noise([9, 3])[1], mixed[0])
    assert not torch.equal(mixed[0], mixed[1])


@pytest.mark.parametrize("other", [dict(window=1), dict(salt=1), dict(rollout_id=5), dict(seed=8)])
def test_another_window_stream_rollout_or_seed_draws_fresh_noise(other):
    assert not torch.equal(noise([5]), noise([5], **other))


def test_pairs_without_their_rows_name_the_missing_column():
    with pytest.raises(KeyError, match=r"train pairs lack 'pair_index' \(.*shard_pairs adds it\); columns: \['x0'\]"):
        pair_generators(ctx(), {"x0": torch.zeros(1)}, 0)


def test_neither_the_role_nor_the_dp_rank_seeds_the_noise():
    a = pair_generators(ctx(), {"pair_index": torch.tensor([1])}, 0)
    frozen = DiffusionLossContext(
        argparse.Namespace(seed=7), "critic", 4, 1, 2, torch.device("cpu"), torch.float32, None, MappingProxyType({})
    )
    b = pair_generators(frozen, {"pair_index": torch.tensor([1])}, 0)
    assert torch.equal(pair_noise(a, SHAPE), pair_noise(b, SHAPE))
