"""The tiny-model toolkit every lineage's tiny builder (`miles/models/<lineage>/tiny.py`) uses: tokenizers built in
code over a byte alphabet plus whole-word tokens for the shapes world (ARCHITECTURE §9), toy-size text encoders and
VAE from configs (the real diffusers/transformers classes), and writing a folder.
"""

from __future__ import annotations

import logging
import string
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL
from tokenizers import AddedToken
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    PreTrainedTokenizerBase,
    Qwen2Tokenizer,
    T5Config,
    T5EncoderModel,
    T5Tokenizer,
)

from miles.models.diffusers_family import write_run_defaults
from miles.models.loading.pretrained import strip_name_or_path

logger = logging.getLogger(__name__)

SHAPES_WORDS: tuple[str, ...] = tuple(
    (
        "a an one two three four five six seven eight nine ten no "
        "red green blue yellow purple orange white black gray grey pink cyan brown "
        "circle circles square squares triangle triangles shape shapes "
        "on the left right top bottom in center middle of and with at near above below next to "
        "photo image picture small large big"
    ).split()
)

CLIP_MAX_LENGTH = 77
T5_MAX_LENGTH = 32
LATENT_CHANNELS = 4
VAE_BLOCK_OUT_CHANNELS = (16, 32, 32)  # three blocks: vae_scale_factor 4
SCHEDULER_SHIFT = 3.0

_CLIP_BOS, _CLIP_EOS = "<|startoftext|>", "<|endoftext|>"


def bytes_to_unicode() -> list[str]:
    """GPT-2 / CLIP byte-level alphabet: one printable character per byte, so any text has no unknown symbols."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def learn_bpe_merges(words: tuple[str, ...], end_of_word: str = "</w>") -> list[tuple[str, str]]:
    """Plain BPE training until every word is one symbol, so applying the merges in order rebuilds each word.

    `end_of_word` marks a word's last symbol (CLIP's "</w>"; "" for byte-level BPE without one, as Qwen2's)."""
    symbols = {w: list(w[:-1]) + [w[-1] + end_of_word] for w in dict.fromkeys(words)}
    merges: list[tuple[str, str]] = []
    while True:
        pairs = Counter(pair for syms in symbols.values() for pair in zip(syms, syms[1:]))
        if not pairs:
            return merges
        best = min(pairs, key=lambda p: (-pairs[p], p))  # most frequent, ties broken lexicographically
        merges.append(best)
        for word, syms in symbols.items():
            merged, i = [], 0
            while i < len(syms):
                if i + 1 < len(syms) and (syms[i], syms[i + 1]) == best:
                    merged.append(syms[i] + syms[i + 1])
                    i += 2
                else:
                    merged.append(syms[i])
                    i += 1
            symbols[word] = merged


def build_clip_tokenizer(words: tuple[str, ...] = SHAPES_WORDS) -> CLIPTokenizer:
    """A CLIP BPE tokenizer: every byte as a symbol (so any text tokenizes) and each of `words` as a single token."""
    vocab: dict[str, int] = {_CLIP_BOS: 0, _CLIP_EOS: 1}
    for ch in bytes_to_unicode():
        vocab.setdefault(ch, len(vocab))
        vocab.setdefault(ch + "</w>", len(vocab))
    merges = learn_bpe_merges(words)
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    # transformers takes (left, right) merge pairs; its annotation names only "left right" strings
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=CLIP_MAX_LENGTH)  # type: ignore[arg-type]


def build_t5_tokenizer(words: tuple[str, ...] = SHAPES_WORDS) -> T5Tokenizer:
    """A T5 unigram tokenizer: characters as cheap fallback pieces, each of `words` (after a space) as one piece.

    Case-sensitive like the real T5 (a normalizer would not survive save/load), so upper case letters are pieces too.
    """
    vocab: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -3.0)]
    for ch in string.ascii_lowercase + string.ascii_uppercase + string.digits + string.punctuation:
        vocab.append((ch, -5.0))
    vocab += [("▁" + w, -1.0) for w in dict.fromkeys(words)]
    return T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=T5_MAX_LENGTH)


QWEN_ENDOFTEXT = "<|endoftext|>"
QWEN_SPECIAL_TOKENS = (
    "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"
)  # fmt: skip


def build_qwen2_tokenizer(words: tuple[str, ...], max_length: int = 128) -> Qwen2Tokenizer:
    """A Qwen2 byte-level BPE tokenizer (Qwen-Image's, Z-Image's and FLUX.2 [klein]'s text encoders, HunyuanVideo
    1.5's): every byte a symbol (any text tokenizes), each of `words` one token both as a word's start and after a
    space (Qwen2's pre-tokenizer keeps the space: "Ġword"), and Qwen's chat and vision special tokens."""
    byte_chars = bytes_to_unicode()
    space = byte_chars[ord(" ")]
    vocab: dict[str, int] = {QWEN_ENDOFTEXT: 0}
    for ch in byte_chars:
        vocab.setdefault(ch, len(vocab))
    merges = learn_bpe_merges(tuple(w for word in words for w in (word, space + word)), end_of_word="")
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    for token in QWEN_SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    # merge pairs, as CLIP's (transformers takes them; its annotation names only "left right" strings)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, model_max_length=max_length)  # type: ignore[arg-type]
    tokenizer.add_tokens([AddedToken(token, special=True, normalized=False) for token in QWEN_SPECIAL_TOKENS])
    return tokenizer


def token_id(tokenizer: PreTrainedTokenizerBase, token: str) -> int:
    """The id of one token (`convert_tokens_to_ids` of a single token, which transformers types with a list's)."""
    found = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(found, int):
        raise TypeError(f"{type(tokenizer).__name__} gave {found!r} as the id of the single token {token!r}")
    return found


def build_clip_text_encoder(tokenizer: CLIPTokenizer, hidden: int) -> CLIPTextModel:
    """A 2-layer CLIP text encoder without a projection head (FLUX's pooled CLIP)."""
    return CLIPTextModel(clip_text_config(tokenizer, hidden))


def build_clip_text_encoder_with_projection(
    tokenizer: CLIPTokenizer, hidden: int, projection: int
) -> CLIPTextModelWithProjection:
    """A 2-layer CLIP text encoder with a projection head of `projection` features (SD3's two CLIPs)."""
    config = clip_text_config(tokenizer, hidden)
    config.projection_dim = projection
    return CLIPTextModelWithProjection(config)


def clip_text_config(tokenizer: CLIPTokenizer, hidden: int) -> CLIPTextConfig:
    """The tiny CLIP text encoders' config: 2 layers of `hidden` features, 2 heads."""
    return CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=CLIP_MAX_LENGTH,
        hidden_act="quick_gelu",
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,  # pooling reads the first eos position
        pad_token_id=tokenizer.pad_token_id,
    )


def build_t5_encoder(
    tokenizer: Any, d_model: int, *, d_kv: int = 16, config_class: type = T5Config, model_class: type = T5EncoderModel
) -> Any:
    """A 2-layer T5-style encoder over `tokenizer`'s vocabulary (UMT5 with `config_class=UMT5Config`, as Wan's)."""
    config = config_class(
        vocab_size=len(tokenizer),
        d_model=d_model,
        d_kv=d_kv,
        d_ff=2 * d_model,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        dropout_rate=0.0,
        feed_forward_proj="gated-gelu",
        is_encoder_decoder=False,
        use_cache=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return model_class(config)


def build_vae(
    resolution: int, block_out_channels: tuple[int, ...] = VAE_BLOCK_OUT_CHANNELS, layers_per_block: int = 1
) -> AutoencoderKL:
    n = len(block_out_channels)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * n,
        up_block_types=("UpDecoderBlock2D",) * n,
        block_out_channels=block_out_channels,
        layers_per_block=layers_per_block,
        latent_channels=LATENT_CHANNELS,
        norm_num_groups=8,
        sample_size=resolution,
        use_quant_conv=False,  # as in SD3's VAE
        use_post_quant_conv=False,
        mid_block_add_attention=True,
    )


@torch.no_grad()
def calibrate_vae(vae: AutoencoderKL, resolution: int, generator: torch.Generator) -> tuple[float, float]:
    """Shift and scale that make the latents of smooth random images zero-mean, unit-variance (as SD3's are)."""
    coarse = torch.rand(16, 3, 4, 4, generator=generator) * 2 - 1
    images = torch.nn.functional.interpolate(coarse, size=(resolution, resolution), mode="bilinear")
    latents = vae.encode(images).latent_dist.mode()
    return float(latents.mean()), float(1.0 / latents.std().clamp_min(1e-6))


# what every tiny builder (each lineage's tiny*.py) does last
def eval_mode(pipe: Any) -> Any:
    """`pipe` with every torch module among its components in eval mode (from-config models start in train mode)."""
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()
    return pipe


def save_tiny_folder(pipe: Any, path: str, **run_defaults: Any) -> str:
    """Write a tiny pipeline as a diffusers folder (safetensors) at `path`, its configs without the build machine's
    paths, and the run defaults it was built for (`write_run_defaults`; none: the pipeline's own). Returns `path`."""
    Path(path).mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(path, safe_serialization=True)
    strip_name_or_path(path)
    if run_defaults:
        write_run_defaults(path, **run_defaults)
    return path
