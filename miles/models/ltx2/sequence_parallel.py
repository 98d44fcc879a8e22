"""LTX-2's audio-video transformer under Ulysses sequence parallelism (--sp-size): diffusers' own forward, with this
rank's chunk of the video tokens and of the audio tokens from the first block to the output norms, and every
attention between the two modalities' token sequences run on whole sequences of H/N heads.

What is split: the video tokens (B, S_v, D) and the audio tokens (B, S_a, D_a) between the first block and
`norm_out` / `audio_norm_out`, each rank holding S_v/N and S_a/N contiguous tokens (chunk `sp.rank` of both). In the
video and audio self-attentions (attn1, audio_attn1) and the audio-to-video / video-to-audio cross-attentions, q, k and
v are projected, q/k-normed (per token, across heads) and rotated on this rank's tokens, with this rank's rows of the
rotary tables (which the transformer builds for every token before the blocks, so each token keeps its full-sequence
position), then exchanged all-to-all so that attention runs on every token of H/N heads, the other modality's keys
whole too; the output comes back to this rank's tokens before the per-head gate and the output projection. The text
cross-attentions (attn2, audio_attn2) keep diffusers' processor: their keys are the whole text on every rank, their
queries this rank's tokens. What stays whole: the rotary tables, the text, the time embeddings (one per sample) and
everything after the last block, which every rank of the group computes alike on the gathered tokens."""

from __future__ import annotations

from collections.abc import Callable

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_ltx2 import (
    LTX2Attention,
    LTX2VideoTransformer3DModel,
    apply_interleaved_rotary_emb,
    apply_split_rotary_emb,
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

Rotary = tuple[torch.Tensor, torch.Tensor]
# the attentions between token sequences (self-attention of each modality, cross-attention between them): Ulysses
ULYSSES_ATTENTIONS = ("attn1", "audio_attn1", "audio_to_video_attn", "video_to_audio_attn")


def rotary_rows(freqs: Rotary) -> int:
    """Tokens of a rotary table: (B, S, D) interleaved, (B, H, S, D/2H) split."""
    return freqs[0].shape[1 if freqs[0].ndim == 3 else 2]


def rotary_chunk(freqs: Rotary, sp: SequenceParallelGroup) -> Rotary:
    """This rank's rows of a whole sequence's rotary table (its tokens' positions)."""
    dim = 1 if freqs[0].ndim == 3 else 2
    return split_sequence(freqs[0], sp, dim), split_sequence(freqs[1], sp, dim)


class UlyssesLTX2Attention:
    """The processor of a block's self-attention or audio-video cross-attention at sp > 1 (diffusers'
    LTX2AudioVideoAttnProcessor on every token of H/N heads): q of this rank's tokens, k and v of this rank's tokens
    of the key modality, each rotated with this rank's rows of its table, all-to-all to whole sequences, attention,
    all-to-all back, the per-head gate of this rank's tokens, the output projection."""

    def __init__(self, sp: SequenceParallelGroup) -> None:
        self.sp = sp

    def __call__(
        self,
        attn: LTX2Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        query_rotary_emb: Rotary | None = None,
        key_rotary_emb: Rotary | None = None,
        perturbation_mask: torch.Tensor | None = None,
        all_perturbed: bool | torch.Tensor | None = None,
    ) -> torch.Tensor:
        if attention_mask is not None:
            raise ValueError("the Ulysses LTX-2 processor runs unmasked self- and audio-video attention only")
        if perturbation_mask is not None or (all_perturbed is not None and bool(all_perturbed)):
            raise ValueError("spatio-temporal guidance (perturbed attention) is not run under sequence parallelism")
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        gate_logits = None if attn.to_gate_logits is None else attn.to_gate_logits(hidden_states)
        # q/k norms are per token (across all heads), so they run on this rank's chunk
        query = attn.norm_q(attn.to_q(hidden_states))
        key = attn.norm_k(attn.to_k(context))
        value = attn.to_v(context)
        if query_rotary_emb is not None:
            rotate = apply_interleaved_rotary_emb if attn.rope_type == "interleaved" else apply_split_rotary_emb
            query = rotate(query, rotary_chunk(query_rotary_emb, self.sp))
            key = rotate(key, rotary_chunk(query_rotary_emb if key_rotary_emb is None else key_rotary_emb, self.sp))
        query, key, value = (sequence_to_heads(t.unflatten(2, (attn.heads, -1)), self.sp) for t in (query, key, value))
        out = dispatch_attention_fn(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False)
        out = heads_to_sequence(out.to(query.dtype), self.sp)  # (B, S/N, H, Dh)
        if gate_logits is not None:  # the factor 2: zero logits gate by 1 (diffusers')
            out = out * (2.0 * torch.sigmoid(gate_logits)).unsqueeze(-1)
        return attn.to_out[1](attn.to_out[0](out.flatten(2, 3)))


def _split_block_inputs(sp: SequenceParallelGroup) -> Callable[[nn.Module, tuple, dict], tuple[tuple, dict]]:
    """Pre-hook of the first block: keep this rank's chunk of the video and of the audio tokens. The rotary tables hold
    one row per token of the whole sequences, so inputs already split (an activation-checkpointing recompute) pass
    as they are."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args or "hidden_states" not in kwargs or kwargs.get("video_rotary_emb") is None:
            raise ValueError("the LTX-2 sequence-parallel split expects the transformer's keyword call of its blocks")
        for tokens, rotary in (("hidden_states", "video_rotary_emb"), ("audio_hidden_states", "audio_rotary_emb")):
            if kwargs[tokens].shape[1] == rotary_rows(kwargs[rotary]):
                kwargs = {**kwargs, tokens: split_sequence(kwargs[tokens], sp)}
        return args, kwargs

    return hook


def _gather_before_output_norm(sp: SequenceParallelGroup) -> Callable[[nn.Module, tuple], tuple]:
    """Pre-hook of `norm_out` / `audio_norm_out`: every rank's chunk, so the output layers and the loss see the whole
    sequence."""

    def hook(module: nn.Module, args: tuple) -> tuple:
        return (gather_sequence(args[0], sp), *args[1:])

    return hook


def shard_ltx2_sequence(network: nn.Module, sp: SequenceParallelGroup) -> None:
    """Run `network` (an LTX2VideoTransformer3DModel) with its video and audio tokens split over `sp` from now on
    (hooks and the processors of `ULYSSES_ATTENTIONS`; weights untouched). Call before FSDP2 wraps it; the caller
    has checked heads and tokens divide by sp.size."""
    transformer = as_class(network, LTX2VideoTransformer3DModel)
    config = transformer.config
    for kind, heads in (("video", config["num_attention_heads"]), ("audio", config["audio_num_attention_heads"])):
        if heads % sp.size:
            raise ValueError(f"--sp-size {sp.size} must divide the transformer's {heads} {kind} attention heads")
    if len(transformer.transformer_blocks) == 0:
        raise ValueError("an LTX-2 transformer without blocks has no sequence to split")
    for block in transformer.transformer_blocks:
        for name in ULYSSES_ATTENTIONS:
            # diffusers runs any processor; set_processor's annotation lists its own
            attention = as_class(block.get_submodule(name), LTX2Attention)
            attention.set_processor(UlyssesLTX2Attention(sp))  # type: ignore[arg-type]
    transformer.transformer_blocks[0].register_forward_pre_hook(_split_block_inputs(sp), with_kwargs=True)
    transformer.norm_out.register_forward_pre_hook(_gather_before_output_norm(sp))
    transformer.audio_norm_out.register_forward_pre_hook(_gather_before_output_norm(sp))
