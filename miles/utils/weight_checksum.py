"""Per-tensor checksums of a weight sync: the trainer's rank 0 computes them on its device over the exported tensors,
each engine recomputes them over what it loaded (`verify_loaded`); a difference names the tensor.

A checksum is exact, not a float tolerance: it sums the tensor's bits read as 16-bit words (0..65535), plain and
weighted by position ((p mod 32749) + 1), the products in int32 and the sums in int64. Integer sums do not depend on
the order or the split of the addition, so the trainer's sum over gathered pieces equals the engine's over the whole
tensor, and any change of one bit or any swap of two different words (not 32749 apart) shows; nothing overflows below
2**31 words (4 GiB) per tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from miles.utils.simulation import simulating

MODULUS = 32749  # the largest prime below 2**15: a word (< 2**16) times its weight (<= 32749) stays below 2**31
CHUNK_WORDS = 1 << 22  # words per pass: bounds the int32 temporaries (two of 16 MiB) on a large tensor's device
_WEIGHTS: dict[torch.device, torch.Tensor] = {}  # per device, the weights of CHUNK_WORDS words from any offset


class WeightSyncError(RuntimeError):
    """An engine holds different weights than the trainer sent, or its adapter does not bind what was trained."""


@dataclass(frozen=True)
class TensorChecksum:
    """One tensor's checksum: dtype and shape as sent, and its two word sums."""

    dtype: str
    shape: tuple[int, ...]
    words: int
    weighted: int


def _raw_words(flat: torch.Tensor) -> torch.Tensor:
    """A contiguous 1-D tensor's bits as 16-bit words, a view (one uint8 word per byte for 1-byte dtypes)."""
    return flat.view(torch.uint8) if flat.element_size() == 1 else flat.view(torch.int16)


def _weights(device: torch.device) -> torch.Tensor:
    """(p mod MODULUS) + 1 for p in [0, CHUNK_WORDS + MODULUS), int32, made once per device: a chunk starting at
    position q takes the slice from q mod MODULUS (no modulo per word)."""
    if device not in _WEIGHTS:
        _WEIGHTS[device] = (torch.arange(CHUNK_WORDS + MODULUS, device=device) % MODULUS + 1).to(torch.int32)
    return _WEIGHTS[device]


def checksum_terms(pieces: Iterable[torch.Tensor]) -> torch.Tensor:
    """(2,) int64 on the pieces' device: the word sum and the position-weighted word sum of consecutive pieces of one
    flat tensor (a gather's pieces, in order). No host synchronisation: callers stack the terms of many tensors and
    move them once. Under the planner's simulation (fake tensors, no bytes to sum) zeros."""
    if simulating():
        return torch.zeros(2, dtype=torch.int64)
    total, position = None, 0
    for piece in pieces:
        flat = piece.detach().contiguous().reshape(-1)
        words = _raw_words(flat)
        for start in range(0, words.numel(), CHUNK_WORDS):
            chunk = words[start : start + CHUNK_WORDS].to(torch.int32) & 0xFFFF  # int16 reads signed
            first = (position + start) % MODULUS
            weights = _weights(chunk.device)[first : first + chunk.numel()]
            terms = torch.stack([chunk.sum(dtype=torch.int64), (chunk * weights).sum(dtype=torch.int64)])
            total = terms if total is None else total + terms
        position += words.numel()
    if total is None:  # an empty tensor
        return torch.zeros(2, dtype=torch.int64)
    return total


def build_checksums(entries: list[tuple[str, torch.dtype, tuple[int, ...], torch.Tensor]]) -> dict[str, TensorChecksum]:
    """(name, dtype, shape, terms) -> checksums, with one device-to-host transfer per device."""
    by_device: dict[torch.device, list[int]] = {}
    for index, (*_, terms) in enumerate(entries):
        by_device.setdefault(terms.device, []).append(index)
    values: dict[int, list[int]] = {}
    for indices in by_device.values():
        stacked = torch.stack([entries[i][3] for i in indices]).cpu().tolist()
        values.update(zip(indices, stacked))
    return {
        name: TensorChecksum(str(dtype).removeprefix("torch."), tuple(shape), *values[i])
        for i, (name, dtype, shape, _) in enumerate(entries)
    }


def tensor_checksums(state: Mapping[str, torch.Tensor]) -> dict[str, TensorChecksum]:
    """The checksum of every tensor of a state dict, each on its own device."""
    return build_checksums([(name, t.dtype, tuple(t.shape), checksum_terms([t])) for name, t in state.items()])


def verify_loaded(
    expected: Mapping[str, TensorChecksum],
    loaded: Mapping[str, torch.Tensor],
    received: Mapping[str, torch.Tensor],
    *,
    version: int,
) -> None:
    """Raise `WeightSyncError` naming every tensor whose bits differ from the trainer's checksum.

    `loaded[name]`: the engine's tensor after the load; `received[name]`: what arrived. A tensor the engine holds in
    the dtype it was sent in is checked as loaded (transit and load); one it holds in another dtype (the LoRA adapter,
    sent as trained, held in the forward dtype) is checked as received, since a cast changes the bits by design."""
    if set(expected) != set(received):
        extra, missing = sorted(set(received) - set(expected)), sorted(set(expected) - set(received))
        raise WeightSyncError(
            f"weights version {version}: the engine received tensors without a trainer checksum {extra[:3]} and "
            f"missed checksummed ones {missing[:3]} ({len(extra)} and {len(missing)}): the export and its checksums "
            "disagree"
        )
    names, entries = [], []
    for name, want in expected.items():
        tensor = loaded[name]
        if str(tensor.dtype).removeprefix("torch.") != want.dtype:
            tensor = received[name]
        names.append(name)
        entries.append((name, tensor.dtype, tuple(tensor.shape), checksum_terms([tensor])))
    got = build_checksums(entries)
    bad = [name for name in names if got[name] != expected[name]]
    if bad:
        first = bad[0]
        raise WeightSyncError(
            f"weights version {version}: {len(bad)} of {len(expected)} tensors differ from what the trainer sent, "
            f"first {first!r} (trainer {expected[first]}, engine {got[first]})"
            + (f", also {bad[1:4]}" if len(bad) > 1 else "")
            + ": the weights were changed between the trainer's export and the engine's load"
        )


BLOCK_WORDS = 64  # `block_terms`: 64-bit words per block (512 bytes)
_MASK = (1 << 64) - 1


def _as_int64(value: int) -> int:
    """A Python integer mod 2**64, read as a signed int64 (what torch's wrapping int64 sums give)."""
    value &= _MASK
    return value - (1 << 64) if value >= 1 << 63 else value


def block_terms(tensor: torch.Tensor) -> torch.Tensor:
    """(2,) int64 on the tensor's device: the weight sync's checksum of one tensor's bytes, as fast as two reads.

    The bytes as 64-bit words in blocks of `BLOCK_WORDS` (the last words and bytes as two more blocks): the sum of
    every word, and the sum of each block's word sum times its block number + 1, both mod 2**64 (torch's int64 sums
    wrap). Any flipped bit, any block written at another place, left stale or partly copied changes them; a swap of
    two words inside one 512-byte block does not (`checksum_terms`, the exact per-word one, is ~20x slower on CPU)."""
    flat = tensor.detach().reshape(-1)
    try:
        raw = flat.view(torch.uint8)
        words = raw[: raw.numel() // 8 * 8].view(torch.int64)
    except RuntimeError:  # a view at an offset that is no multiple of 8 bytes: read a copy
        raw = flat.clone().view(torch.uint8)
        words = raw[: raw.numel() // 8 * 8].view(torch.int64)
    blocks = words.numel() // BLOCK_WORDS
    sums = words[: blocks * BLOCK_WORDS].view(blocks, BLOCK_WORDS).sum(dim=1)
    tail = torch.stack([words[blocks * BLOCK_WORDS :].sum(), raw[words.numel() * 8 :].to(torch.int64).sum()])
    sums = torch.cat([sums, tail])
    weights = torch.arange(1, sums.numel() + 1, dtype=torch.int64, device=sums.device)
    return torch.stack([sums.sum(), (sums * weights).sum()])


def block_terms_range(raw: torch.Tensor, start: int, total: int) -> torch.Tensor:
    """(2,) int64: the share of `block_terms` of bytes [start, start + raw.numel()) of a tensor of `total` bytes, `raw`
    those bytes (uint8, 8-byte aligned in memory). The shares of any split of a tensor into such ranges sum (mod
    2**64) to its `block_terms`, so each writer of a part can checksum what it wrote while it is in cache. `start` is a
    multiple of 8, and the range ends at one or at the tensor's end."""
    end = start + raw.numel()
    if start % 8 or (end % 8 and end != total) or end > total:
        raise ValueError(f"block_terms_range: bytes [{start}, {end}) of {total} do not lie on 64-bit words")
    whole = total // 8 * 8  # the tensor's bytes in whole words; the rest is summed byte by byte
    words = raw[: max(0, min(end, whole) - start)].view(torch.int64)
    first = start // 8
    head = min(words.numel(), -first % BLOCK_WORDS)  # the words before the range's first block boundary
    blocks = (words.numel() - head) // BLOCK_WORDS
    body = words[head : head + blocks * BLOCK_WORDS].view(blocks, BLOCK_WORDS).sum(dim=1)
    block = (first + head) // BLOCK_WORDS + 1  # the weight of the first whole block
    weights = torch.arange(block, block + blocks, dtype=torch.int64, device=raw.device)
    head_sum, tail_sum = words[:head].sum(), words[head + blocks * BLOCK_WORDS :].sum()
    plain = head_sum + body.sum() + tail_sum
    weighted = head_sum * (first // BLOCK_WORDS + 1) + (body * weights).sum() + tail_sum * (block + blocks)
    if end == total and total > whole:  # the last bytes, a block of their own
        rest = raw[whole - start :].to(torch.int64).sum()
        plain, weighted = plain + rest, weighted + rest * (whole // 8 // BLOCK_WORDS + 2)
    return torch.stack([plain, weighted])


def block_terms_reference(data: bytes) -> tuple[int, int]:
    """`block_terms` over raw bytes, in plain Python integers (the tests' independent computation)."""
    whole = len(data) // 8 * 8
    words = [int.from_bytes(data[i : i + 8], "little", signed=True) for i in range(0, whole, 8)]
    blocks = len(words) // BLOCK_WORDS
    sums = [sum(words[b * BLOCK_WORDS : (b + 1) * BLOCK_WORDS]) for b in range(blocks)]
    sums += [sum(words[blocks * BLOCK_WORDS :]), sum(data[whole:])]
    return _as_int64(sum(sums)), _as_int64(sum(s * (i + 1) for i, s in enumerate(sums)))
