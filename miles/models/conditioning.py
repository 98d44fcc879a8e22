"""`Conditioning`: a batch of a family's prompt conditioning as named, batch-first tensors, and its train-pair columns.

A family picks the names (SD3: `prompt_embeds`, `pooled_prompt_embeds`); every operation here is generic over them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from types import MappingProxyType

import torch

# Train-pair columns of a conditioning: f"{prefix}{COLUMN_NAMESPACE}{name}", e.g. "cond/prompt_embeds" and, with the
# prefix "negative_", "negative_cond/prompt_embeds".
COLUMN_NAMESPACE = "cond/"

RowIndex = int | slice | Sequence[int] | torch.Tensor


class Conditioning(Mapping[str, torch.Tensor]):
    """Named tensors that share their first (batch) dimension; read-only (operations return new instances).

    A mapping: `cond["prompt_embeds"]`, `list(cond)` in the family's order. Floating tensors follow `to(dtype=...)`;
    integer and boolean ones (masks, token ids) keep their dtype.
    """

    __slots__ = ("_tensors",)

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        if not tensors:
            raise ValueError("a Conditioning needs at least one named tensor")
        sizes = {}
        for name, value in tensors.items():
            if not isinstance(value, torch.Tensor) or value.ndim == 0:
                raise ValueError(f"conditioning {name!r} must be a tensor with a batch dimension, got {value!r:.80}")
            sizes[name] = value.shape[0]
        if len(set(sizes.values())) != 1:
            shapes = {name: tuple(value.shape) for name, value in tensors.items()}
            raise ValueError(f"conditioning tensors disagree on the batch size: {shapes}")
        self._tensors = MappingProxyType(dict(tensors))

    # the mapping
    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            return self._tensors[name]
        except KeyError:
            raise KeyError(f"this conditioning has no {name!r}; it holds {list(self._tensors)}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def __repr__(self) -> str:
        shapes = ", ".join(f"{n}={tuple(t.shape)}:{str(t.dtype).removeprefix('torch.')}" for n, t in self.items())
        return f"Conditioning({shapes})"

    def __reduce__(self):
        return (Conditioning, (dict(self._tensors),))

    @property
    def batch_size(self) -> int:
        return next(iter(self._tensors.values())).shape[0]

    # batch operations
    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Conditioning:
        """`fn` applied to every tensor (it must keep the batch dimension first)."""
        return Conditioning({name: fn(value) for name, value in self._tensors.items()})

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> Conditioning:
        """Moved to `device`; floating tensors cast to `dtype` (masks and ids keep theirs)."""

        def move(value: torch.Tensor) -> torch.Tensor:
            return value.to(device=device, dtype=dtype if dtype is not None and value.is_floating_point() else None)

        return self.map(move)

    def rows(self, index: RowIndex) -> Conditioning:
        """Rows of the batch; an integer index keeps the batch dimension (size 1)."""
        if isinstance(index, int):
            index = slice(index, index + 1 if index != -1 else None)
        return self.map(lambda value: value[index])

    def expand(self, batch_size: int) -> Conditioning:
        """A batch of 1 broadcast to `batch_size` rows (views, no copy); a batch of `batch_size` as it is."""
        if self.batch_size == batch_size:
            return self
        if self.batch_size != 1:
            raise ValueError(f"can only expand a batch of 1 to {batch_size}, got a batch of {self.batch_size}")
        return self.map(lambda value: value.expand(batch_size, *value.shape[1:]))

    def repeat_interleave(self, repeats: int) -> Conditioning:
        """Each row `repeats` times in a row (row i -> rows i*repeats .. i*repeats+repeats-1)."""
        return self.map(lambda value: value.repeat_interleave(repeats, dim=0))

    @staticmethod
    def cat(items: Sequence[Conditioning]) -> Conditioning:
        """Concatenated along the batch; every item must hold the same names.

        Sequences may differ in length: where a name's tensors (rank >= 2) differ in dimension 1 only, the shorter
        are zero-padded at its end to the longest (`pad_sequences`). A family whose prompt length varies from batch
        to batch keeps a mask of its own in which 0 marks padding (Qwen-Image's `prompt_embeds_mask`), so this
        padding changes nothing it computes; families with fixed-length sequences never see it."""
        if not items:
            raise ValueError("Conditioning.cat needs at least one item")
        names = list(items[0])
        for item in items[1:]:
            if list(item) != names:
                raise ValueError(f"Conditioning.cat: names differ, {names} vs {list(item)}")
        return Conditioning({name: torch.cat(pad_sequences([item[name] for item in items], name)) for name in names})

    # train-pair columns
    def to_columns(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """The tensors as train-pair columns named f"{prefix}cond/{name}"."""
        return {column_name(name, prefix): value for name, value in self._tensors.items()}

    @staticmethod
    def from_columns(columns: Mapping[str, torch.Tensor], prefix: str = "") -> Conditioning:
        """The conditioning stored in train-pair columns by `to_columns(prefix)`; other columns are ignored."""
        start = prefix + COLUMN_NAMESPACE
        tensors = {key[len(start) :]: value for key, value in columns.items() if key.startswith(start)}
        if not tensors:
            raise KeyError(f"the train pairs hold no {start}* columns (conditioning); columns: {sorted(columns)}")
        return Conditioning(tensors)


def pad_sequences(tensors: Sequence[torch.Tensor], name: str = "tensor") -> list[torch.Tensor]:
    """`tensors` zero-padded at the end of dimension 1 to the longest; every other dimension past the batch must
    agree (an error naming `name` otherwise). Tensors already of that length are returned as they are."""
    shapes = {tuple(t.shape[2:]) if t.ndim >= 2 else None for t in tensors}
    lengths = {t.shape[1] for t in tensors if t.ndim >= 2}
    if len(lengths) <= 1:
        return list(tensors)
    if len(shapes) != 1 or None in shapes:
        raise ValueError(
            f"conditioning {name!r}: cannot pad {[tuple(t.shape) for t in tensors]} to one length "
            "(only dimension 1, the sequence, may differ)"
        )
    longest = max(lengths)
    padded = []
    for t in tensors:
        if t.shape[1] < longest:
            t = torch.cat([t, t.new_zeros(t.shape[0], longest - t.shape[1], *t.shape[2:])], dim=1)
        padded.append(t)
    return padded


def column_name(name: str, prefix: str = "") -> str:
    """The train-pair column of conditioning tensor `name`."""
    return f"{prefix}{COLUMN_NAMESPACE}{name}"


def has_conditioning(columns: Mapping[str, torch.Tensor], prefix: str = "") -> bool:
    """Whether `columns` hold a conditioning stored with `prefix`."""
    return any(key.startswith(prefix + COLUMN_NAMESPACE) for key in columns)
