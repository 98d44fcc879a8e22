"""One recipe for every random stream derived from ids (seed, rollout, rank, index, a stream constant...): the ids
go through numpy's SeedSequence, so nearby ids give independent streams and the same ids the same stream in every
process (Python's `hash()` of a tuple is neither documented nor portable)."""

from __future__ import annotations

import random

import numpy as np
import torch

_ID_MASK = (1 << 64) - 1  # SeedSequence takes non-negative integers; negative seeds wrap


def _entropy(ids: tuple[int, ...]) -> list[int]:
    return [int(i) & _ID_MASK for i in ids]


def stream_seed(*ids: int) -> int:
    """A 32-bit seed of the stream named by `ids` (for `torch.Generator.manual_seed` and per-sample seeds)."""
    return int(np.random.SeedSequence(_entropy(ids)).generate_state(1)[0])


def stream_rng(*ids: int) -> np.random.Generator:
    """A numpy generator of the stream named by `ids`."""
    return np.random.default_rng(_entropy(ids))


def stream_generator(*ids: int) -> torch.Generator:
    """A CPU torch generator of the stream named by `ids`."""
    return torch.Generator(device="cpu").manual_seed(stream_seed(*ids))


def seed_everything(seed: int) -> None:
    """Python's, NumPy's and torch's global generators from `seed` (a trainer rank's at its start)."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
