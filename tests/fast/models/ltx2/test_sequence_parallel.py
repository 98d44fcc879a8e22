"""LTX-2's transformer under Ulysses sequence parallelism (miles/models/ltx2/sequence_parallel.py), in one process:
the rotary tables' rows of either layout and this rank's chunk of them, the first block's split of both streams
(inputs already split pass; only the keyword call is accepted), the processors on the attentions between token
sequences and not on the text's, the hooks, and the refusals naming each stream. The 2-rank equality with the plain
transformer: tests/fast/backends/fsdp_utils/test_sequence_parallel_families.py."""

from __future__ import annotations

import pytest
import torch
from diffusers import LTX2VideoTransformer3DModel

from miles.models.ltx2.sequence_parallel import (
    ULYSSES_ATTENTIONS,
    UlyssesLTX2Attention,
    _split_block_inputs,
    rotary_chunk,
    rotary_rows,
    shard_ltx2_sequence,
)
from miles.models.sequence_parallel import SequenceParallelGroup

RANK_1_OF_2 = SequenceParallelGroup(None, 2, 1)  # the split alone issues no collective


@pytest.fixture
def transformer(tiny_ltx2_dir):
    """The tiny folder's architecture with fresh weights (2 video heads, 2 audio heads, 2 blocks)."""
    config = LTX2VideoTransformer3DModel.load_config(tiny_ltx2_dir, subfolder="transformer")
    return LTX2VideoTransformer3DModel.from_config(config)


def test_rotary_tables_of_either_layout_give_their_rows_and_this_ranks_chunk():
    interleaved = (torch.arange(6.0).view(1, 6, 1).expand(1, 6, 4), torch.zeros(1, 6, 4))  # (B, S, D)
    split = (torch.arange(6.0).view(1, 1, 6, 1).expand(1, 2, 6, 2), torch.zeros(1, 2, 6, 2))  # (B, H, S, D/2H)
    assert rotary_rows(interleaved) == rotary_rows(split) == 6
    cos, sin = rotary_chunk(interleaved, RANK_1_OF_2)
    assert cos[0, :, 0].tolist() == [3.0, 4.0, 5.0] and sin.shape == (1, 3, 4)
    cos, sin = rotary_chunk(split, RANK_1_OF_2)
    assert cos[0, 0, :, 0].tolist() == [3.0, 4.0, 5.0] and sin.shape == (1, 2, 3, 2)


def test_the_first_block_keeps_this_ranks_chunk_of_each_stream_and_passes_inputs_already_split():
    hook = _split_block_inputs(RANK_1_OF_2)
    video, audio = torch.arange(8.0).view(1, 8, 1), torch.arange(4.0).view(1, 4, 1)
    tables = {"video_rotary_emb": (torch.zeros(1, 8, 2),) * 2, "audio_rotary_emb": (torch.zeros(1, 4, 2),) * 2}
    _, kwargs = hook(None, (), {"hidden_states": video, "audio_hidden_states": audio, **tables})
    assert kwargs["hidden_states"].flatten().tolist() == [4.0, 5.0, 6.0, 7.0]
    assert kwargs["audio_hidden_states"].flatten().tolist() == [2.0, 3.0]
    _, again = hook(None, (), kwargs)  # an activation-checkpointing recompute
    assert again["hidden_states"] is kwargs["hidden_states"]
    with pytest.raises(ValueError, match="expects the transformer's keyword call of its blocks"):
        hook(None, (video,), {})


def test_sharding_installs_the_processors_on_the_sequence_attentions_only(transformer):
    shard_ltx2_sequence(transformer, RANK_1_OF_2)
    for block in transformer.transformer_blocks:
        for name in ULYSSES_ATTENTIONS:
            assert isinstance(getattr(block, name).processor, UlyssesLTX2Attention), name
        for name in ("attn2", "audio_attn2"):  # the text cross-attentions: whole text keys on every rank
            assert not isinstance(getattr(block, name).processor, UlyssesLTX2Attention), name
    hooked = [transformer.transformer_blocks[0], transformer.norm_out, transformer.audio_norm_out]
    assert all(len(module._forward_pre_hooks) == 1 for module in hooked)
    assert not transformer.transformer_blocks[1]._forward_pre_hooks


@pytest.mark.parametrize(("video", "audio", "stream"), [(2, 4, "video"), (4, 2, "audio")])
def test_heads_the_size_does_not_divide_are_refused_naming_their_stream(tiny_ltx2_dir, video, audio, stream):
    config = LTX2VideoTransformer3DModel.load_config(tiny_ltx2_dir, subfolder="transformer")
    transformer = LTX2VideoTransformer3DModel.from_config(
        {**config, "num_attention_heads": video, "audio_num_attention_heads": audio, "num_layers": 1}
    )
    with pytest.raises(ValueError, match=rf"--sp-size 4 must divide the transformer's 2 {stream} attention heads"):
        shard_ltx2_sequence(transformer, SequenceParallelGroup(None, 4, 0))
