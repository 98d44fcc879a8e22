"""The prompt cache (`--prompt-cache`): cached engines sample bit for bit as uncached ones, a second engine loads no
text encoder, a stale or damaged entry is encoded again, and the key follows what computes an encoding."""

from __future__ import annotations

import argparse
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from miles.models.base import get_train_pipeline_config
from miles.rollout.engine import DiffusionEngine
from miles.rollout.engine_api import GenerateRequest
from miles.rollout.prompt_cache import (
    DEFAULT_SUBDIR,
    PromptCacheConfig,
    encoder_fingerprint,
    prompt_cache_config,
    row_digest,
    tensors_checksum,
)
from miles.rollout.prompt_encoder import PromptEncoder
from miles.utils.threads import torch_threads

PROMPTS = ["a red circle", "two blue squares", "a red circle", "a green triangle"]  # a prompt twice, as in a group
CPU = torch.device("cpu")


def request(prompts=PROMPTS, **overrides):
    values = dict(
        prompts=list(prompts),
        seeds=list(range(7, 7 + len(prompts))),
        num_steps=3,
        guidance_scale=3.5,
        negative_prompt="blurry",
        sde_type="sde",
        noise_level=0.7,
        trained_steps=[0, 1],
        decode=False,
        return_negative=True,
    )
    values.update(overrides)
    return GenerateRequest(**values)


def assert_same_samples(a, b):
    for name in ("final_latents", "latents", "next_latents", "log_probs"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    for cond_a, cond_b in ((a.conditioning, b.conditioning), (a.negative, b.negative)):
        assert list(cond_a) == list(cond_b)
        assert all(torch.equal(cond_a[k], cond_b[k]) for k in cond_a)


def config(family, directory) -> PromptCacheConfig:
    return PromptCacheConfig(str(directory), encoder_fingerprint(family, torch.float32, str(directory)))


def test_a_cached_engine_samples_bit_for_bit_as_an_uncached_one_and_a_second_loads_no_text_encoder(
    tiny_flux_dev_dir, tmp_path
):
    plain = DiffusionEngine(tiny_flux_dev_dir)
    assert plain.family.prompt_cache_exact
    expected = plain.generate(request())
    cache = config(plain.family, tmp_path)

    first = DiffusionEngine(tiny_flux_dev_dir, prompt_cache=cache)
    assert not first.prompt_encoder.loaded  # nothing to encode yet
    assert first.fill_prompt_cache(PROMPTS, ["blurry"]) == {"found": 0, "encoded": 4}  # 3 prompts and the negative
    assert first.fill_prompt_cache(PROMPTS[:2], ["blurry"]) == {"found": 3, "encoded": 0}
    assert first.release_text_encoders() and "text" not in first.family._loaded
    assert_same_samples(first.generate(request()), expected)
    assert not first.prompt_encoder.loaded  # every row came from the cache

    second = DiffusionEngine(tiny_flux_dev_dir, prompt_cache=cache)  # the next run, same folder
    assert_same_samples(second.generate(request()), expected)
    assert not second.prompt_encoder.loaded and "text" not in second.family._loaded
    assert second.prompt_encoder.stats == {"read": 4, "encoded": 0}

    new = ["a yellow star", "a red circle"]  # a prompt outside the cached set loads the encoders again
    assert_same_samples(second.generate(request(new)), plain.generate(request(new)))
    assert second.prompt_encoder.loaded and second.prompt_encoder.stats["encoded"] == 1


@pytest.fixture(scope="module")
def flux_family(tiny_flux_dev_dir):
    return get_train_pipeline_config(tiny_flux_dev_dir)


def entry_path(encoder: PromptEncoder, kind: str, text: str) -> Path:
    cache = encoder._cache()
    return cache.path(row_digest(cache.key, kind, text))


def damage_truncate(path: Path, other: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def damage_flip_a_value(path: Path, other: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40  # inside the last tensor's bytes: the header still parses
    path.write_bytes(bytes(data))


def damage_another_prompts_entry(path: Path, other: Path) -> None:
    shutil.copyfile(other, path)  # a well-formed entry, checksum and all, of another prompt


def damage_values_and_checksum_of_another_key(path: Path, other: Path) -> None:
    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata())
    tensors = {k: torch.zeros_like(v) for k, v in load_file(str(path)).items()}
    save_file(tensors, str(path), metadata={**meta, "key": "0" * 64, "checksum": tensors_checksum(tensors)})


@pytest.mark.parametrize(
    "damage",
    [damage_truncate, damage_flip_a_value, damage_another_prompts_entry, damage_values_and_checksum_of_another_key],
)
def test_a_stale_or_damaged_entry_is_encoded_again_never_used(flux_family, tmp_path, caplog, damage):
    encoder = PromptEncoder(flux_family, config(flux_family, tmp_path), flux_family.text_pipeline, CPU)
    truth = flux_family.encode_prompts(["a red circle"])
    encoder.encode_request(["a red circle", "two blue squares"], None, "", negative=False)
    path = entry_path(encoder, "prompt", "a red circle")
    damage(path, entry_path(encoder, "prompt", "two blue squares"))

    with caplog.at_level(logging.WARNING, logger="miles.rollout.prompt_cache"):
        embeds, _ = encoder.encode_request(["a red circle"], None, "", negative=False)
    assert all(torch.equal(embeds[k], truth[k]) for k in truth)
    assert str(path) in caplog.text and encoder.stats["encoded"] == 3  # two first, then the damaged one again
    rewritten = encoder._cache().load(path.stem)
    assert rewritten is not None and all(torch.equal(rewritten[k], truth[k]) for k in truth)


def test_the_key_follows_the_encoders_tokenizer_dtype_device_and_inputs_not_the_transformer(
    tiny_flux_dev_dir, tmp_path
):
    folder = Path(shutil.copytree(tiny_flux_dev_dir, tmp_path / "pipeline"))
    memo = tmp_path / "cache"
    memo.mkdir()

    def fingerprint(dtype=torch.float32):
        return encoder_fingerprint(get_train_pipeline_config(str(folder)), dtype, str(memo))

    base = fingerprint()
    assert fingerprint() == base  # remembered digests give the same answer
    with open(next((folder / "transformer").glob("*.safetensors")), "ab") as f:
        f.write(b"\0")  # the trained network is no part of an encoding
    assert fingerprint() == base
    assert fingerprint(torch.bfloat16) != base
    weights = next((folder / "text_encoder_2").glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # same size; the memo must still notice (mtime)
    weights.write_bytes(bytes(data))
    changed = fingerprint()
    assert changed != base
    tokenizer = folder / "tokenizer_2" / "tokenizer_config.json"
    tokenizer.write_text(tokenizer.read_text() + " ")
    assert fingerprint() not in (base, changed)

    image = np.zeros((4, 4, 3), np.uint8)
    rows = {
        row_digest("k", "prompt", "a"),
        row_digest("k", "negative", "a"),
        row_digest("k2", "prompt", "a"),
        row_digest("k", "prompt", "a", [image]),
        row_digest("k", "prompt", "a", [image + 1]),
    }
    assert len(rows) == 5 and row_digest("k", "prompt", "a", [image]) == row_digest("k", "prompt", "a", [image.copy()])
    encoder = PromptEncoder(get_train_pipeline_config(str(folder)), PromptCacheConfig(str(memo), base), None, CPU)
    with torch_threads(1):
        one_thread = encoder.cache_key()
    with torch_threads(2):
        assert encoder.cache_key() != one_thread  # CPU kernels split their sums by thread: the count joins the key


def test_the_flag_caches_where_exact_by_default_anywhere_on_request_and_nowhere_when_off(
    tiny_flux_dev_dir, tiny_pipeline_dir, tmp_path
):
    exact, inexact = get_train_pipeline_config(tiny_flux_dev_dir), get_train_pipeline_config(tiny_pipeline_dir)
    assert exact.prompt_cache_exact and not inexact.prompt_cache_exact  # SD3's pooled CLIP projection

    def resolve(value, family):
        args = argparse.Namespace(prompt_cache=value, output_dir=str(tmp_path / "out"))
        return prompt_cache_config(args, family, torch.float32)

    assert resolve("auto", exact).directory == str(tmp_path / "out" / DEFAULT_SUBDIR)
    assert resolve("auto", inexact) is None and resolve("off", exact) is None
    assert resolve(str(tmp_path / "mine"), inexact).directory == str(tmp_path / "mine")
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError, match="--prompt-cache"):
        resolve(str(tmp_path / "file"), exact)
