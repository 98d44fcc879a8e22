"""Wan's transformer under Ulysses sequence parallelism (miles/models/wan/sequence_parallel.py), in one process: the
rotary embedding on interleaved pairs, the first block's split of the tokens (inputs already split pass), the
processors and hooks installed, the refusals, and a transformer sharded over a group of one computing what the plain
one does (the 2-rank equality: tests/fast/backends/fsdp_utils/test_sequence_parallel.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from miles.models.sequence_parallel import SequenceParallelGroup
from miles.models.wan.sequence_parallel import (
    UlyssesWanSelfAttention,
    _split_block_inputs,
    apply_rotary,
    shard_wan_sequence,
)
from miles.models.wan.tiny import tiny_wan_transformer

RANK_1_OF_2 = SequenceParallelGroup(None, 2, 1)  # the split alone issues no collective


@pytest.fixture(scope="module")
def transformer():
    torch.manual_seed(0)
    return tiny_wan_transformer(16).eval()  # 2 heads of 16, 2 blocks


def test_the_rotary_embedding_turns_each_interleaved_pair_by_its_angle():
    x, angles = torch.randn(2, 5, 3, 8), torch.randn(1, 5, 1, 4)
    cos, sin = (f(angles).repeat_interleave(2, dim=-1) for f in (torch.cos, torch.sin))  # Wan's tables
    turned = torch.view_as_complex(x.unflatten(-1, (-1, 2)).contiguous()) * torch.polar(torch.ones(()), angles)
    torch.testing.assert_close(apply_rotary(x, cos, sin), torch.view_as_real(turned).flatten(-2))


def test_the_first_block_keeps_this_ranks_chunk_and_passes_inputs_already_split():
    hook = _split_block_inputs(RANK_1_OF_2)
    tokens, rotary = torch.arange(8.0).view(1, 8, 1), (torch.zeros(1, 8, 1, 4), torch.zeros(1, 8, 1, 4))
    (split, *rest), kwargs = hook(None, (tokens, "text", "temb", rotary), {})
    assert split.flatten().tolist() == [4.0, 5.0, 6.0, 7.0] and rest == ["text", "temb", rotary] and kwargs == {}
    (again, *_), _ = hook(None, (split, "text", "temb", rotary), {})  # an activation-checkpointing recompute
    assert again is split


def test_sharding_installs_the_processors_and_refuses_what_it_cannot_split(transformer):
    with pytest.raises(ValueError, match="--sp-size 4 must divide the transformer's 2 heads"):
        shard_wan_sequence(copy.deepcopy(transformer), SequenceParallelGroup(None, 4, 0))
    sharded = copy.deepcopy(transformer)
    shard_wan_sequence(sharded, RANK_1_OF_2)
    assert all(isinstance(b.attn1.processor, UlyssesWanSelfAttention) for b in sharded.blocks)
    assert not any(isinstance(b.attn2.processor, UlyssesWanSelfAttention) for b in sharded.blocks)  # the text's
    with pytest.raises(ValueError, match="self-attention only"):
        sharded.blocks[0].attn1.processor(sharded.blocks[0].attn1, torch.zeros(1, 2, 32), torch.zeros(1, 2, 32))


def test_a_transformer_sharded_over_one_rank_computes_the_plain_ones_output(transformer, sp_group_of_one):
    inputs = dict(
        hidden_states=torch.randn(2, 4, 2, 4, 4),
        timestep=torch.tensor([100, 700]),
        encoder_hidden_states=torch.randn(2, 5, 16),
        return_dict=False,
    )
    sharded = copy.deepcopy(transformer)
    shard_wan_sequence(sharded, sp_group_of_one)
    with torch.no_grad():
        torch.testing.assert_close(sharded(**inputs)[0], transformer(**inputs)[0], rtol=1e-5, atol=1e-6)
