"""`PromptEncoder`: how a rollout engine turns a request's prompts (and source images) into conditioning, through the
prompt cache (`miles.rollout.prompt_cache`) when there is one, loading the text encoders only when an entry is missing
and freeing them once the run's prompt set is cached."""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from miles.models.base import TrainPipelineConfig
from miles.models.conditioning import Conditioning
from miles.rollout.prompt_cache import PromptCache, PromptCacheConfig, device_signature, row_digest

logger = logging.getLogger(__name__)

PROMPT, NEGATIVE = "prompt", "negative"
# prompts a fill encodes per call where the family's rows do not depend on their batch (`prompt_cache_exact`);
# elsewhere one at a time, since a row is then what its prompt encodes alone
FILL_BATCH = 16


def fill_step(family: TrainPipelineConfig, micro_batch: int | None = None) -> int:
    """Prompts a cache fill encodes at once: `FILL_BATCH` where a batch encodes each prompt as it encodes alone
    (`prompt_cache_exact`), else one (an entry must be what the family gives the prompt alone); never more than the
    engine's `micro_batch` (samples per forward, None: no bound): its text encoder runs in micro-batches too (LTX-2's
    Gemma 3 12B at 1024 tokens rises 18.7 GiB encoding 16 prompts)."""
    step = FILL_BATCH if family.prompt_cache_exact else 1
    return step if micro_batch is None else max(1, min(step, micro_batch))


class PromptEncoder:
    """Without a cache: the family's own batch encoding (`encode_request`), text encoders loaded at once. With one:
    each distinct row (a prompt with its source images, or a negative prompt) read from its entry, or encoded alone
    and stored; the text encoders load at the first entry missing (`load_text_encoders()`), and
    `release_text_encoders` frees them."""

    def __init__(
        self,
        family: TrainPipelineConfig,
        config: PromptCacheConfig | None,
        load_text_encoders: Callable[[], Any],
        device: torch.device,
    ) -> None:
        self.family, self.config, self.device = family, config, device
        self._load = load_text_encoders
        self.loaded = False
        self.stats = {"read": 0, "encoded": 0}
        if config is None:
            self._ensure_loaded()

    def _ensure_loaded(self, why: str = "") -> None:
        if not self.loaded:
            if why:
                logger.info("prompt cache: %s: loading the text encoders", why)
            self._load()
            self.loaded = True

    def cache_key(self) -> str | None:
        """The key of the entries this encoder reads and writes now: the encoders' fingerprint with the device's
        signature (on CPU the current thread count); None without a cache."""
        if self.config is None:
            return None
        return row_digest(self.config.fingerprint, "device", device_signature(self.device))

    def _cache(self) -> PromptCache:
        key = self.cache_key()
        assert self.config is not None and key is not None, "a prompt cache needs --prompt-cache-dir"
        return PromptCache(self.config.directory, key)

    def encode_request(
        self,
        prompts: list[str],
        source_images: list[list[np.ndarray]] | None,
        negative_prompt: str,
        *,
        negative: bool,
    ) -> tuple[Conditioning, Conditioning | None]:
        """`TrainPipelineConfig.encode_request`'s conditioning of a request (rows on the engine's device): the family's
        own without a cache, each row's entry with one."""
        if self.config is None:
            return self.family.encode_request(
                prompts, source_images, negative_prompt, negative=negative, device=self.device
            )
        self.family.check_source_images(len(prompts), source_images)
        cache = self._cache()
        images = [None] * len(prompts) if source_images is None else source_images
        embeds = self._rows(cache, PROMPT, prompts, images)
        if not negative:
            return embeds, None
        if source_images is not None and self.family.negative_per_prompt:
            return embeds, self._rows(cache, NEGATIVE, [negative_prompt] * len(prompts), images)
        return embeds, self._rows(cache, NEGATIVE, [negative_prompt], [None])

    def fill(
        self, prompts: Sequence[str], negative_prompts: Sequence[str], *, micro_batch: int | None = None
    ) -> dict[str, int]:
        """Make sure every text-only prompt and negative prompt has an entry (encoding those missing `fill_step` at a
        time); returns how many were found and how many encoded."""
        cache, before = self._cache(), dict(self.stats)
        rows = {text: row_digest(cache.key, PROMPT, text) for text in prompts}
        missing = [text for text, row in rows.items() if cache.load(row) is None]
        self.stats["read"] += len(rows) - len(missing)
        step = fill_step(self.family, micro_batch)
        for start in range(0, len(missing), step):
            chunk = missing[start : start + step]
            self._ensure_loaded(f"{len(missing)} of {len(rows)} prompts not in {cache.root}")
            batch = self.family.encode_prompts(chunk, device=self.device)
            for i, text in enumerate(chunk):
                cache.store(rows[text], batch.rows(i), text)
            self.stats["encoded"] += len(chunk)
        for text in dict.fromkeys(negative_prompts):
            self._row(cache, NEGATIVE, text, None, keep=False)
        return {"found": self.stats["read"] - before["read"], "encoded": self.stats["encoded"] - before["encoded"]}

    def release_text_encoders(self) -> bool:
        """Free the text encoders (with a cache only: without one every request needs them); whether any were held."""
        if self.config is None or not self.loaded:
            return False
        self.family.release_text_encoders()
        self.loaded = False
        logger.info("prompt cache: text encoders freed (the run's prompts are in %s)", self.config.directory)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return True

    def _rows(
        self, cache: PromptCache, kind: str, texts: list[str], images: Sequence[list[np.ndarray] | None]
    ) -> Conditioning:
        """The rows of `texts` (with their images), each distinct one read or encoded once, joined in order."""
        found: dict[str, Conditioning] = {}
        order = []
        for text, own in zip(texts, images):
            row = row_digest(cache.key, kind, text, own)
            if row not in found:
                conditioning = self._row(cache, kind, text, own, row=row)
                assert conditioning is not None  # keep=True: the row itself
                found[row] = conditioning
            order.append(row)
        return Conditioning.cat([found[row] for row in order])

    def _row(
        self,
        cache: PromptCache,
        kind: str,
        text: str,
        images: list[np.ndarray] | None,
        *,
        row: str | None = None,
        keep: bool = True,
    ) -> Conditioning | None:
        """One row on the engine's device: its trusted entry, or encoded alone and stored. `keep=False` (filling)
        returns nothing and reads no tensors back beyond the entry's check."""
        row = row or row_digest(cache.key, kind, text, images)
        cached = cache.load(row)
        if cached is not None:
            self.stats["read"] += 1
            return cached.to(self.device) if keep else None
        self._ensure_loaded(f"{text[:60]!r} is not in {cache.root}")
        cond = self._encode_alone(kind, text, images)
        cache.store(row, cond, text)
        self.stats["encoded"] += 1
        return cond if keep else None

    def _encode_alone(self, kind: str, text: str, images: list[np.ndarray] | None) -> Conditioning:
        """One row as the family encodes it in a batch of one: a prompt (with its source images), the shared text
        negative, or the negative of one prompt's source images (`negative_per_prompt` families)."""
        family, device = self.family, self.device
        if kind == PROMPT:
            sources = None if images is None else [images]
            return family.encode_request([text], sources, "", negative=False, device=device)[0]
        if images is not None:
            return family.encode_negative_of_images(text, [images], device)
        return family.encode_prompts([text], device=device)
