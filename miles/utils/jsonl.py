"""Reading JSONL files line by line with errors that name the file and the line (prompt files, preference files)."""

from __future__ import annotations

import json
import os
from typing import Any


def read_jsonl_objects(path: str, error: type[Exception], where: str = "") -> list[tuple[int, dict[str, Any]]]:
    """(line number, object) of every non-blank line of `path`. A missing file, a line that is not UTF-8, not JSON
    or not a JSON object, and a file with no object raise `error` naming the file and the line; `where` (the flag and
    value that named the file, say) ends each message in parentheses."""
    tail = f" ({where})" if where else ""
    if not os.path.isfile(path):
        raise error(f"{where or path}: file not found")
    rows, line_no = [], 0
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise error(
                    f"{path}:{line_no}: not UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1}){tail}"
                ) from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise error(f"{path}:{line_no}: not valid JSON ({exc.msg}){tail}") from None
            if not isinstance(row, dict):
                raise error(f"{path}:{line_no}: expected a JSON object, got {type(row).__name__}{tail}")
            rows.append((line_no, row))
    if not rows:
        what = "the file is empty" if line_no == 0 else f"its {line_no} line(s) are blank"
        raise error(f"{path}:{max(line_no, 1)}: no records ({what}){tail}")
    return rows
