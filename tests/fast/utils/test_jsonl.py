"""JSONL reading: (line number, object) of every non-blank line; every kind of bad file fails naming file and line."""

from __future__ import annotations

import pytest

from miles.utils.jsonl import read_jsonl_objects


class BadFile(Exception):
    pass


def write(tmp_path, data: bytes) -> str:
    path = tmp_path / "rows.jsonl"
    path.write_bytes(data)
    return str(path)


def test_objects_come_with_their_line_numbers_and_blank_lines_are_skipped(tmp_path):
    path = write(tmp_path, b'{"a": 1}\n\n  \n{"b": "\xc3\xa9"}\n')
    assert read_jsonl_objects(path, BadFile) == [(1, {"a": 1}), (4, {"b": "é"})]


@pytest.mark.parametrize(
    "data, message",
    [
        (b'{"a": 1}\n\xff\n', r"rows.jsonl:2: not UTF-8 \(byte 0xff at column 1\) \(--prompt-data rows.jsonl\)"),
        (b'{"a": 1}\n{"a": \n', r"rows.jsonl:2: not valid JSON \(.*\) \(--prompt-data"),
        (b"[1, 2]\n", r"rows.jsonl:1: expected a JSON object, got list \(--prompt-data"),
        (b"", r"rows.jsonl:1: no records \(the file is empty\)"),
        (b"\n\n\n", r"rows.jsonl:3: no records \(its 3 line\(s\) are blank\)"),
    ],
    ids=["not-utf8", "not-json", "not-an-object", "empty", "blank"],
)
def test_a_bad_file_fails_naming_the_file_the_line_and_where(tmp_path, data, message):
    with pytest.raises(BadFile, match=message):
        read_jsonl_objects(write(tmp_path, data), BadFile, where="--prompt-data rows.jsonl")


def test_a_missing_file_is_named_by_where_or_its_path(tmp_path):
    with pytest.raises(BadFile, match="^--prompt-data x.jsonl: file not found$"):
        read_jsonl_objects(str(tmp_path / "x.jsonl"), BadFile, where="--prompt-data x.jsonl")
    with pytest.raises(BadFile, match="x.jsonl: file not found"):
        read_jsonl_objects(str(tmp_path / "x.jsonl"), BadFile)
