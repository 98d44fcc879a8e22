"""JSON values as a train-pairs column: one row of UTF-8 bytes per value, zero-padded to the longest (uint8 (B, L)),
so that what is not a tensor (a prompt's metadata, which a differentiable reward scores against) travels, shards and
slices with the pairs like any other column."""

from __future__ import annotations

import json
from typing import Any

import torch


def encode_json_column(values: list[Any]) -> torch.Tensor:
    """(len(values), L) uint8: row i the JSON of values[i] (sorted keys), zero-padded; L ≥ 1."""
    rows = [json.dumps(value, sort_keys=True).encode("utf-8") for value in values]
    width = max([len(row) for row in rows] + [1])
    column = torch.zeros(len(rows), width, dtype=torch.uint8)
    for i, row in enumerate(rows):
        column[i, : len(row)] = torch.frombuffer(bytearray(row), dtype=torch.uint8)
    return column


def decode_json_column(column: torch.Tensor) -> list[Any]:
    """The values `encode_json_column` wrote (any subset or order of its rows)."""
    if column.dtype != torch.uint8 or column.ndim != 2:
        raise ValueError(f"a JSON column is uint8 (B, L), got {column.dtype} {tuple(column.shape)}")
    return [json.loads(bytes(row.tolist()).rstrip(b"\0").decode("utf-8")) for row in column.cpu()]
