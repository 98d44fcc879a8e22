"""How an engine turns prompts into conditioning (miles/rollout/prompt_encoder.py), on a stand-in family that counts
its calls: without a cache the family's batch encoding with the text encoders loaded at once; with one, each distinct
row read or encoded alone, the encoders loaded at the first missing entry, a fill batched only where the family's rows
do not depend on their batch, and the encoders freed once the prompts are cached."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from miles.models.conditioning import Conditioning
from miles.rollout import prompt_encoder
from miles.rollout.prompt_cache import PromptCacheConfig
from miles.rollout.prompt_encoder import PromptEncoder

CPU = torch.device("cpu")


def embed(text: str, images: list[np.ndarray] | None = None) -> Conditioning:
    """A row that names its text (its length and first letter) and the mean of its images."""
    mean = float(np.mean([i.mean() for i in images])) if images else 0.0
    return Conditioning({"prompt_embeds": torch.tensor([[len(text), ord(text[0]) if text else 0, mean]])})


class CountingFamily:
    """The family calls PromptEncoder makes, each counted."""

    negative_per_prompt = True

    def __init__(self, exact: bool = True) -> None:
        self.prompt_cache_exact = exact
        self.batches: list[list[str]] = []
        self.released = 0

    def encode_prompts(self, prompts, device=None):
        self.batches.append(list(prompts))
        return Conditioning.cat([embed(p) for p in prompts])

    def encode_request(self, prompts, source_images, negative_prompt, *, negative, device=None):
        self.batches.append(list(prompts))
        images = source_images or [None] * len(prompts)
        rows = Conditioning.cat([embed(p, i) for p, i in zip(prompts, images)])
        return rows, (embed(negative_prompt) if negative else None)

    def encode_negative_of_images(self, text, images, device):
        return embed(text, images[0])

    def check_source_images(self, count, source_images):
        if source_images is not None and len(source_images) != count:
            raise ValueError("one list of source images per prompt")

    def release_text_encoders(self):
        self.released += 1


@pytest.fixture
def loads():
    calls = []
    return calls, lambda: calls.append(1)


def test_without_a_cache_the_family_encodes_the_batch_with_its_encoders_loaded_at_once(loads):
    calls, load = loads
    family = CountingFamily()
    encoder = PromptEncoder(family, None, load, CPU)
    assert calls == [1] and encoder.loaded and encoder.cache_key() is None
    embeds, negative = encoder.encode_request(["ab", "c"], None, "neg", negative=True)
    assert embeds["prompt_embeds"][:, 0].tolist() == [2, 1] and negative["prompt_embeds"][0, 0] == 3
    assert family.batches == [["ab", "c"]] and not encoder.release_text_encoders()  # every request needs them


def test_with_a_cache_each_distinct_row_is_encoded_once_then_read(loads, tmp_path):
    calls, load = loads
    family = CountingFamily()
    encoder = PromptEncoder(family, PromptCacheConfig(str(tmp_path), "fp"), load, CPU)
    assert calls == [] and encoder.cache_key() is not None  # nothing to encode yet
    embeds, negative = encoder.encode_request(["red", "blue", "red"], None, "", negative=True)
    assert calls == [1] and family.batches == [["red"], ["blue"], [""]]  # alone, the repeated prompt once
    assert embeds["prompt_embeds"][:, 0].tolist() == [3, 4, 3] and negative["prompt_embeds"].shape == (1, 3)
    assert encoder.stats == {"read": 0, "encoded": 3}  # two prompts and the negative
    again = PromptEncoder(family, PromptCacheConfig(str(tmp_path), "fp"), load, CPU)
    repeat, _ = again.encode_request(["blue", "red"], None, "", negative=False)
    assert repeat["prompt_embeds"][:, 0].tolist() == [4, 3] and again.stats == {"read": 2, "encoded": 0}
    assert calls == [1] and not again.loaded  # every row from the cache: no encoder loaded
    assert not again.release_text_encoders() and family.released == 0  # nothing held
    assert encoder.release_text_encoders() and family.released == 1 and not encoder.loaded


def test_source_images_are_part_of_a_row_and_the_negative_is_per_prompt(loads, tmp_path):
    _, load = loads
    encoder = PromptEncoder(CountingFamily(), PromptCacheConfig(str(tmp_path), "fp"), load, CPU)
    images = [[np.full((2, 2, 3), 10, np.uint8)], [np.full((2, 2, 3), 20, np.uint8)]]
    embeds, negative = encoder.encode_request(["edit", "edit"], images, "bad", negative=True)
    assert embeds["prompt_embeds"][:, 2].tolist() == [10, 20] and negative["prompt_embeds"][:, 2].tolist() == [10, 20]
    with pytest.raises(ValueError, match="one list of source images per prompt"):
        encoder.encode_request(["edit"], images, "", negative=False)


@pytest.mark.parametrize(("exact", "batch"), [(True, 2), (False, 1)])
def test_a_fill_encodes_what_is_missing_batched_only_where_rows_do_not_depend_on_their_batch(
    loads, tmp_path, monkeypatch, exact, batch
):
    monkeypatch.setattr(prompt_encoder, "FILL_BATCH", 2)  # 16: as many entries written, slowly
    calls, load = loads
    family = CountingFamily(exact)
    encoder = PromptEncoder(family, PromptCacheConfig(str(tmp_path), "fp"), load, CPU)
    prompts = [f"prompt {i}" for i in range(3)]
    assert encoder.fill(prompts, ["", ""]) == {"found": 0, "encoded": 3 + 1}
    assert family.batches == [prompts[i : i + batch] for i in range(0, len(prompts), batch)] + [[""]]
    assert encoder.fill(prompts[:3], [""]) == {"found": 4, "encoded": 0} and calls == [1]


@pytest.mark.parametrize(("micro_batch", "batch"), [(None, 16), (3, 3), (1, 1), (40, 16)])
def test_a_fill_encodes_at_most_the_engines_micro_batch(loads, tmp_path, micro_batch, batch):
    """The text encoder runs in the engine's micro-batches as the transformer does (`fill_step`)."""
    _, load = loads
    family = CountingFamily(True)
    encoder = PromptEncoder(family, PromptCacheConfig(str(tmp_path), "fp"), load, CPU)
    prompts = [f"prompt {i}" for i in range(20)]
    encoder.fill(prompts, [], micro_batch=micro_batch)
    assert family.batches == [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
