"""The engine's copy of a bucket tensor into its parameter, summed chunk by chunk while in cache
(`receiver.copy_and_terms`): the same bytes as `copy_` and the same terms as `block_terms` of what was loaded, at
every size around the chunk and block boundaries, for every dtype, and through the plain path (a cast, a view)."""

from __future__ import annotations

import pytest
import torch

from miles.utils.weight_checksum import block_terms
from miles.weight_sync import receiver


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
def test_the_chunked_copy_loads_the_same_bytes_and_gives_block_terms_of_them(monkeypatch, dtype):
    monkeypatch.setattr(receiver, "CHUNK_BYTES", 1024)  # two blocks: many chunks at small sizes
    generator = torch.Generator().manual_seed(0)
    for numel in (1, 255, 2048, 2049, 4096 + 5, 9000):
        source = torch.randint(-100, 100, (numel,), generator=generator).to(dtype)
        if dtype.is_floating_point:
            source = torch.randn(numel, generator=generator).to(dtype)
        target = torch.zeros(numel, dtype=dtype)
        terms = receiver.copy_and_terms(target, source)
        assert torch.equal(target, source)
        assert torch.equal(terms, block_terms(source)), (dtype, numel)
        # a flipped bit in the last chunk (as a copy that went wrong there would leave it) changes the terms
        target.view(torch.uint8)[-1] ^= 1
        assert not torch.equal(block_terms(target), terms)


def test_a_cast_or_a_strided_target_takes_the_plain_copy(monkeypatch):
    monkeypatch.setattr(receiver, "CHUNK_BYTES", 1024)
    source = torch.randn(64, 64)
    cast = torch.zeros(64, 64, dtype=torch.bfloat16)
    assert torch.equal(receiver.copy_and_terms(cast, source), block_terms(source))  # as sent: the cast is by design
    assert torch.equal(cast, source.to(torch.bfloat16))
    strided = torch.zeros(64, 64).t()
    assert torch.equal(receiver.copy_and_terms(strided, source), block_terms(strided))
    assert torch.equal(strided, source)
