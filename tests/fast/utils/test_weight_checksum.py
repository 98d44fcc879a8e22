"""Weight-sync checksums against a plain NumPy computation of the same sums, their independence of how a tensor is
split, and what they catch: one flipped bit, two swapped values, a cast, a missing tensor."""

import numpy as np
import pytest
import torch

from miles.utils.weight_checksum import (
    MODULUS,
    TensorChecksum,
    WeightSyncError,
    checksum_terms,
    tensor_checksums,
    verify_loaded,
)


def numpy_checksum(tensor: torch.Tensor) -> tuple[int, int]:
    """The definition, word by word in Python integers: bytes as little-endian uint16 words (uint8 for 1-byte)."""
    raw = tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    words = np.frombuffer(raw, dtype=np.uint8 if tensor.element_size() == 1 else "<u2").astype(object)
    weights = (np.arange(len(words), dtype=object) % MODULUS) + 1
    return int(words.sum()), int((words * weights).sum())


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.bool]
)
def test_the_checksum_is_the_word_sums_numpy_computes(dtype):
    g = torch.Generator().manual_seed(0)
    tensor = (torch.randn(7, 13, generator=g) * 100).to(dtype)
    want = numpy_checksum(tensor)
    got = tensor_checksums({"w": tensor})["w"]
    assert (got.words, got.weighted) == want
    assert got.dtype == str(dtype).removeprefix("torch.") and got.shape == (7, 13)


def test_pieces_and_chunks_give_the_whole_tensors_checksum(monkeypatch):
    tensor = torch.randn(70_001, generator=torch.Generator().manual_seed(1))
    whole = checksum_terms([tensor])
    pieces = checksum_terms([tensor[:123], tensor[123:50_000], tensor[50_000:50_000], tensor[50_000:]])
    monkeypatch.setattr("miles.utils.weight_checksum.CHUNK_WORDS", 1000)  # positions carried across chunks
    monkeypatch.setattr("miles.utils.weight_checksum._WEIGHTS", {})
    chunked = checksum_terms([tensor])
    assert whole.tolist() == pieces.tolist() == chunked.tolist() == list(numpy_checksum(tensor))


def test_one_flipped_bit_and_two_swapped_values_change_it():
    tensor = torch.randn(4096, generator=torch.Generator().manual_seed(2))
    flipped = tensor.clone()
    flipped.view(torch.int32)[1234] ^= 1  # the lowest mantissa bit: 1 ulp
    swapped = tensor.clone()
    swapped[[10, 3000]] = swapped[[3000, 10]]
    base = tensor_checksums({"w": tensor})["w"]
    assert tensor_checksums({"w": flipped})["w"] != base
    flipped_c, swapped_c = tensor_checksums({"w": flipped})["w"], tensor_checksums({"w": swapped})["w"]
    assert flipped_c.words != base.words
    assert swapped_c.words == base.words and swapped_c.weighted != base.weighted  # only the position weights see it


def test_verify_loaded_names_the_tensor_and_checks_a_cast_one_as_received():
    sent = {"a.weight": torch.randn(8, 4), "b.lora_A.weight": torch.randn(2, 4)}
    expected = tensor_checksums(sent)
    # the adapter is held in bf16: checked as received; `a` as loaded
    loaded = {"a.weight": sent["a.weight"].clone(), "b.lora_A.weight": sent["b.lora_A.weight"].to(torch.bfloat16)}
    verify_loaded(expected, loaded, sent, version=3)
    loaded["a.weight"][2, 1] += 1e-3
    with pytest.raises(WeightSyncError, match=r"version 3: 1 of 2 tensors differ .* first 'a.weight'"):
        verify_loaded(expected, loaded, sent, version=3)
    with pytest.raises(WeightSyncError, match=r"missed checksummed ones \['b.lora_A.weight'\]"):
        verify_loaded(expected, loaded, {"a.weight": sent["a.weight"]}, version=3)
    assert isinstance(expected["a.weight"], TensorChecksum)
