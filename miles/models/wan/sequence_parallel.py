"""Wan's transformer under Ulysses sequence parallelism (--sp-size): diffusers' own forward, with this rank's chunk of
the tokens from the first block to the output norm, and self-attention run on every token of H/N heads.

What is split: the patch tokens (B, S, D) between the first block and `norm_out`, each rank holding S/N contiguous
tokens. What stays whole: the rotary table (built from the full latent shape before the blocks), the text and time
embeddings, cross-attention's keys (the text), and everything after the last block (output norm, projection,
unpatchify), which every rank of the group computes alike on the gathered tokens."""

from __future__ import annotations

from collections.abc import Callable

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_wan import WanAttention, WanTransformer3DModel, WanTransformerBlock
from torch import nn

from miles.models.loading.pretrained import as_class
from miles.models.sequence_parallel import (
    SequenceParallelGroup,
    gather_sequence,
    heads_to_sequence,
    sequence_to_heads,
    split_sequence,
)


def apply_rotary(x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """Wan's rotary embedding of (B, S, H, Dh) on interleaved pairs, as WanAttnProcessor applies it."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = freqs_cos[..., 0::2], freqs_sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


class UlyssesWanSelfAttention:
    """The processor of a block's self-attention (attn1) at sp > 1: q, k, v of this rank's tokens, all-to-all to
    every token of H/N heads, the rotary embedding at the full sequence's positions, attention, all-to-all back."""

    def __init__(self, sp: SequenceParallelGroup) -> None:
        self.sp = sp

    def __call__(
        self,
        attn: WanAttention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if encoder_hidden_states is not None or attention_mask is not None or attn.fused_projections:
            raise ValueError("the Ulysses processor runs Wan's self-attention only (no mask, unfused projections)")
        # q/k norms are per token (across all heads), so they run on this rank's chunk
        query = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))
        key = attn.norm_k(attn.to_k(hidden_states)).unflatten(2, (attn.heads, -1))
        value = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1))
        query, key, value = (sequence_to_heads(t, self.sp) for t in (query, key, value))
        if rotary_emb is not None:
            query, key = apply_rotary(query, *rotary_emb), apply_rotary(key, *rotary_emb)
        out = dispatch_attention_fn(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False)
        out = heads_to_sequence(out.type_as(query), self.sp).flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


def _split_block_inputs(sp: SequenceParallelGroup) -> Callable[[nn.Module, tuple, dict], tuple[tuple, dict]]:
    """Pre-hook of the first block: keep this rank's chunk of the tokens. The rotary table (argument 3) holds one row
    per token of the whole sequence, so inputs already split (an activation-checkpointing recompute) pass as they
    are."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        hidden_states, rest = args[0], args[1:]
        if hidden_states.shape[1] != rest[2][0].shape[1]:
            return args, kwargs
        return (split_sequence(hidden_states, sp), *rest), kwargs

    return hook


def _gather_before_output_norm(sp: SequenceParallelGroup) -> Callable[[nn.Module, tuple], tuple]:
    """Pre-hook of `norm_out`: every rank's chunk, so the output layers and the loss see the whole sequence."""

    def hook(module: nn.Module, args: tuple) -> tuple:
        return (gather_sequence(args[0], sp), *args[1:])

    return hook


def shard_wan_sequence(network: nn.Module, sp: SequenceParallelGroup) -> None:
    """Run `network` (a WanTransformer3DModel) with its tokens split over `sp` from now on (hooks and attn1
    processors; weights untouched). Call before FSDP2 wraps it; the caller has checked heads and tokens divide by
    sp.size."""
    transformer = as_class(network, WanTransformer3DModel)
    heads = transformer.config["num_attention_heads"]
    if heads % sp.size:
        raise ValueError(f"--sp-size {sp.size} must divide the transformer's {heads} heads")
    if len(transformer.blocks) == 0:
        raise ValueError("a Wan transformer without blocks has no sequence to split")
    for block in transformer.blocks:
        # diffusers runs any processor; set_processor's annotation lists its own
        as_class(block, WanTransformerBlock).attn1.set_processor(UlyssesWanSelfAttention(sp))  # type: ignore[arg-type]
    transformer.blocks[0].register_forward_pre_hook(_split_block_inputs(sp), with_kwargs=True)
    transformer.norm_out.register_forward_pre_hook(_gather_before_output_norm(sp))
