"""HunyuanVideo 1.5's transformer under Ulysses sequence parallelism (--sp-size): diffusers' own forward, with this
rank's chunk of the video tokens from the first dual-stream block to the output norm, and the joint (video + text)
attention run on every video token of H/N heads.

What is split: the video patch tokens (B, S, D) between the first block and `norm_out`, each rank holding S/N
contiguous tokens. The text stream (the reordered Qwen2.5-VL, ByT5 and image-embedding tokens with their mask) stays
whole on every rank, as do the rotary table, the time embedding and everything after the last block. In each block's
joint attention the video q, k, v of this rank's tokens (per-head q/k norms and the rotary embedding at their rows of
the whole sequence's table) go all-to-all to every token of H/N heads; the text q, k, v, projected on every rank,
keep the same H/N heads; attention runs on [video; text] with the pipeline's mask; the video output returns to this
rank's tokens and the text output's heads are gathered from the group (its backward sums the group's gradients, as
the gather after the last block does), so every rank carries the whole text stream on to the next block."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.attention_processor import Attention
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_hunyuan_video15 import (
    HunyuanVideo15Transformer3DModel,
    HunyuanVideo15TransformerBlock,
)
from torch import nn

from miles.models.loading.pretrained import as_class
from miles.models.sequence_parallel import (
    SequenceParallelGroup,
    gather_sequence,
    heads_to_sequence,
    sequence_to_heads,
    split_sequence,
)


class UlyssesHunyuanVideo15Attention:
    """The processor of a dual-stream block's joint attention at sp > 1 (diffusers' HunyuanVideo15AttnProcessor2_0
    on every video token of H/N heads and the whole text of the same heads)."""

    def __init__(self, sp: SequenceParallelGroup) -> None:
        self.sp = sp

    def __call__(
        self,
        attn: Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if encoder_hidden_states is None or attention_mask is None:
            raise ValueError("the Ulysses HunyuanVideo 1.5 processor runs the joint video + text attention only")
        sp = self.sp
        query, key, value = (
            proj(hidden_states).unflatten(2, (attn.heads, -1)) for proj in (attn.to_q, attn.to_k, attn.to_v)
        )
        if attn.norm_q is None or attn.norm_k is None:
            raise ValueError("the Ulysses HunyuanVideo 1.5 processor expects the blocks' q/k norms (qk_norm)")
        query, key = attn.norm_q(query), attn.norm_k(key)  # per head: on this rank's tokens
        if image_rotary_emb is not None:
            rows = tuple(split_sequence(t, sp, dim=0) for t in image_rotary_emb)  # this rank's tokens' positions
            # diffusers annotates the (cos, sin) pair it takes as a 1-tuple
            query = apply_rotary_emb(query, rows, sequence_dim=1)  # type: ignore[arg-type]
            key = apply_rotary_emb(key, rows, sequence_dim=1)  # type: ignore[arg-type]
        query, key, value = (sequence_to_heads(t, sp) for t in (query, key, value))
        text = [
            proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
            for proj in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
        ]
        if attn.norm_added_q is not None:
            text[0] = attn.norm_added_q(text[0])
        if attn.norm_added_k is not None:
            text[1] = attn.norm_added_k(text[1])
        text = [split_sequence(t, sp, dim=2) for t in text]  # this rank's heads of the whole text
        query, key, value = (torch.cat([t, e], dim=1) for t, e in zip((query, key, value), text))

        # the pipeline's mask: video tokens always valid, each text token per the mask, pairs valid where both are
        batch, seq_len = query.shape[:2]
        mask = F.pad(attention_mask, (seq_len - attention_mask.shape[1], 0), value=True).bool()
        rows_mask = mask.view(batch, 1, 1, seq_len).repeat(1, 1, seq_len, 1)
        mask = rows_mask & rows_mask.transpose(2, 3)
        out = dispatch_attention_fn(query, key, value, attn_mask=mask, dropout_p=0.0, is_causal=False)
        out = out.to(query.dtype)
        text_len = encoder_hidden_states.shape[1]
        video = heads_to_sequence(out[:, :-text_len], sp).flatten(2, 3)
        text_out = gather_sequence(out[:, -text_len:].contiguous(), sp, dim=2).flatten(2, 3)
        video = attn.to_out[1](attn.to_out[0](video))
        return video, attn.to_add_out(text_out)


def _split_block_inputs(sp: SequenceParallelGroup) -> Callable[[nn.Module, tuple], tuple]:
    """Pre-hook of the first block (called positionally: hidden_states, encoder_hidden_states, temb, mask, rotary):
    keep this rank's chunk of the video tokens. The rotary table holds one row per token of the whole sequence, so
    inputs already split (an activation-checkpointing recompute) pass as they are."""

    def hook(module: nn.Module, args: tuple) -> tuple:
        if len(args) < 5 or args[4] is None:
            raise ValueError("the HunyuanVideo 1.5 sequence-parallel split expects the transformer's positional call")
        hidden_states, rest = args[0], args[1:]
        if hidden_states.shape[1] != args[4][0].shape[0]:
            return args
        return (split_sequence(hidden_states, sp), *rest)

    return hook


def _gather_before_output_norm(sp: SequenceParallelGroup) -> Callable[[nn.Module, tuple], tuple]:
    """Pre-hook of `norm_out`: every rank's chunk, so the output layers and the loss see the whole sequence."""

    def hook(module: nn.Module, args: tuple) -> tuple:
        return (gather_sequence(args[0], sp), *args[1:])

    return hook


def shard_hunyuan_video15_sequence(network: nn.Module, sp: SequenceParallelGroup) -> None:
    """Run `network` (a HunyuanVideo15Transformer3DModel) with its video tokens split over `sp` from now on (hooks and
    the blocks' attention processors; weights untouched). Call before FSDP2 wraps it; the caller has checked heads
    and tokens divide by sp.size."""
    transformer = as_class(network, HunyuanVideo15Transformer3DModel)
    heads = transformer.config["num_attention_heads"]
    if heads % sp.size:
        raise ValueError(f"--sp-size {sp.size} must divide the transformer's {heads} heads")
    if len(transformer.transformer_blocks) == 0:
        raise ValueError("a HunyuanVideo 1.5 transformer without blocks has no sequence to split")
    for block in transformer.transformer_blocks:
        # diffusers runs any processor; set_processor's annotation lists its own
        attention = as_class(block, HunyuanVideo15TransformerBlock).attn
        attention.set_processor(UlyssesHunyuanVideo15Attention(sp))  # type: ignore[arg-type]
    transformer.transformer_blocks[0].register_forward_pre_hook(_split_block_inputs(sp))
    transformer.norm_out.register_forward_pre_hook(_gather_before_output_norm(sp))
