"""JSON values as a train-pairs column: one row of UTF-8 bytes per value, zero-padded to the longest (uint8 (B, L)),
so that what is not a tensor (a prompt's metadata, which a differentiable reward scores against) travels, shards and
slices with the pairs like any other column."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

_STAND_INS: list[Any] = []  # `fake_rows_decode_as`'s values, innermost last


def encode_json_column(values: list[Any]) -> torch.Tensor:
    """(len(values), L) uint8: row i the JSON of values[i] (sorted keys), zero-padded; L ≥ 1."""
    rows = [json.dumps(value, sort_keys=True).encode("utf-8") for value in values]
    width = max([len(row) for row in rows] + [1])
    column = torch.zeros(len(rows), width, dtype=torch.uint8)
    for i, row in enumerate(rows):
        column[i, : len(row)] = torch.frombuffer(bytearray(row), dtype=torch.uint8)
    return column


@contextmanager
def fake_rows_decode_as(value: Any) -> Iterator[None]:
    """Under the planner's fake tensors a JSON column holds no bytes: while this is active each row of a fake column
    decodes to a copy of `value` (a representative row: the planner's is the first prompt record's), so that the code reading it (a
    differentiable reward scoring against a prompt's metadata) runs on the shapes a real run's would."""
    _STAND_INS.append(value)
    try:
        yield
    finally:
        _STAND_INS.pop()


def decode_json_column(column: torch.Tensor) -> list[Any]:
    """The values `encode_json_column` wrote (any subset or order of its rows); of a fake column (the planner's), the
    stand-in of `fake_rows_decode_as`."""
    if column.dtype != torch.uint8 or column.ndim != 2:
        raise ValueError(f"a JSON column is uint8 (B, L), got {column.dtype} {tuple(column.shape)}")
    if isinstance(column, FakeTensor):
        if not _STAND_INS:
            raise ValueError("a fake JSON column holds no bytes: decode it inside fake_rows_decode_as(a stand-in row)")
        return [copy.deepcopy(_STAND_INS[-1]) for _ in range(column.shape[0])]
    return [json.loads(bytes(row.tolist()).rstrip(b"\0").decode("utf-8")) for row in column.cpu()]
