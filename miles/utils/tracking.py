"""Metrics sinks: one JSON object per line in `metrics.jsonl`, flushed as it is written."""

from __future__ import annotations

import json
import math
import os
from typing import Any


class MetricsWriter:
    def __init__(self, output_dir: str, filename: str = "metrics.jsonl") -> None:
        os.makedirs(output_dir, exist_ok=True)
        self.path = os.path.join(output_dir, filename)
        self._file = open(self.path, "a", buffering=1)

    def log(self, record: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._file.write(json.dumps(clean, sort_keys=True) + "\n")

    def close(self) -> None:
        self._file.close()


def read_metrics(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
