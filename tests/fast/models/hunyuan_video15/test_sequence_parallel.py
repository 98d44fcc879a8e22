"""HunyuanVideo 1.5's transformer under Ulysses sequence parallelism
(miles/models/hunyuan_video15/sequence_parallel.py), in one process: the joint attention's processor over a group of
one computing what diffusers' own processor does (mask, rotary, text stream), the first block's split of the video
tokens (inputs already split pass; only the positional call is accepted), the processors and hooks installed, and the
refusals. The 2-rank equality with the plain transformer: tests/fast/backends/fsdp_utils/
test_sequence_parallel_families.py."""

from __future__ import annotations

import pytest
import torch
from diffusers import HunyuanVideo15Transformer3DModel
from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15AttnProcessor2_0

from miles.models.hunyuan_video15.sequence_parallel import (
    UlyssesHunyuanVideo15Attention,
    _split_block_inputs,
    shard_hunyuan_video15_sequence,
)
from miles.models.sequence_parallel import SequenceParallelGroup

RANK_1_OF_2 = SequenceParallelGroup(None, 2, 1)  # the split alone issues no collective


@pytest.fixture
def transformer(tiny_hunyuan_video15_dir):
    """The tiny folder's architecture with fresh weights (2 heads of 8, 1 dual-stream block)."""
    config = HunyuanVideo15Transformer3DModel.load_config(tiny_hunyuan_video15_dir, subfolder="transformer")
    torch.manual_seed(0)
    return HunyuanVideo15Transformer3DModel.from_config(config).eval()


def test_the_joint_attention_over_one_rank_is_diffusers_own(transformer, sp_group_of_one):
    attn = transformer.transformer_blocks[0].attn
    video, text = torch.randn(2, 6, 16), torch.randn(2, 3, 16)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])  # padded text tokens
    angles = torch.randn(6, 8)
    rotary = (angles.cos(), angles.sin())
    with torch.no_grad():
        expected = HunyuanVideo15AttnProcessor2_0()(attn, video, text, mask, rotary)
        got = UlyssesHunyuanVideo15Attention(sp_group_of_one)(attn, video, text, mask, rotary)
    for mine, theirs in zip(got, expected):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="runs the joint video \\+ text attention only"):
        UlyssesHunyuanVideo15Attention(sp_group_of_one)(attn, video)


def test_the_first_block_keeps_this_ranks_video_tokens_and_passes_inputs_already_split():
    hook = _split_block_inputs(RANK_1_OF_2)
    video, rotary = torch.arange(8.0).view(1, 8, 1), (torch.zeros(8, 4), torch.zeros(8, 4))
    split, *rest = hook(None, (video, "text", "temb", "mask", rotary))
    assert split.flatten().tolist() == [4.0, 5.0, 6.0, 7.0] and rest == ["text", "temb", "mask", rotary]
    assert hook(None, (split, "text", "temb", "mask", rotary))[0] is split  # an activation-checkpointing recompute
    with pytest.raises(ValueError, match="expects the transformer's positional call"):
        hook(None, (video, "text", "temb", "mask", None))


def test_sharding_installs_the_processors_and_hooks_and_refuses_what_it_cannot_split(transformer):
    with pytest.raises(ValueError, match="--sp-size 4 must divide the transformer's 2 heads"):
        shard_hunyuan_video15_sequence(transformer, SequenceParallelGroup(None, 4, 0))
    shard_hunyuan_video15_sequence(transformer, RANK_1_OF_2)
    assert all(isinstance(b.attn.processor, UlyssesHunyuanVideo15Attention) for b in transformer.transformer_blocks)
    assert (
        len(transformer.transformer_blocks[0]._forward_pre_hooks) == len(transformer.norm_out._forward_pre_hooks) == 1
    )
