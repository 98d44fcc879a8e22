"""How every conversion stores the negative (CFG) conditioning in train pairs: one row copied to every pair."""

from __future__ import annotations

import torch

from miles.models.conditioning import Conditioning

NEGATIVE_PREFIX = "negative_"  # the prefix `conditioning_from_pairs(..., prefix="negative_")` reads back


def negative_columns(negative: Conditioning, num_pairs: int) -> dict[str, torch.Tensor]:
    """The engine's negative conditioning as `negative_cond/*` columns of `num_pairs` rows (copies, so a shard or a
    hook writing one row never aliases the others): one row copied to every pair, or (a family whose negative
    encodes each prompt's source images) one row per sample, repeated over its sample-major pairs."""
    if negative.batch_size not in (1, num_pairs):
        if num_pairs % negative.batch_size:
            raise ValueError(f"{negative.batch_size} negative rows do not divide {num_pairs} sample-major pairs")
        negative = negative.repeat_interleave(num_pairs // negative.batch_size)
    return negative.expand(num_pairs).map(torch.Tensor.clone).to_columns(prefix=NEGATIVE_PREFIX)
