import json

import pytest

from miles.arguments.parser import default_args
from miles.rollout.data_source import (
    PromptDataError,
    PromptDataSource,
    check_distinct_prompts,
    read_jsonl_records,
    read_prompt_file,
    records_digest,
)


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_epochs_cover_every_record_once_and_resume_is_stateless():
    source = PromptDataSource(10, 4, seed=3)
    stream = [i for r in range(5) for i in source.indices(r)]
    assert sorted(stream[:10]) == list(range(10)) and sorted(stream[10:20]) == list(range(10))
    assert PromptDataSource(10, 4, seed=3).indices(3) == source.indices(3)
    assert PromptDataSource(10, 4, seed=4).indices(0) != source.indices(0)
    assert PromptDataSource(10, 4, seed=3, shuffle=False).indices(1) == [4, 5, 6, 7]


def test_checkpointed_state_reports_a_resume_over_other_data_or_settings():
    records = [{"prompt": f"p{i}"} for i in range(10)]
    source = PromptDataSource(10, 4, seed=3, digest=records_digest(records))
    state = source.state_dict(5)
    assert state["next_rollout_id"] == 5 and state["epoch"] == 2  # 5 rollouts x 4 prompts over 10 records
    assert source.resume_mismatches(state, 5) == []
    edited = [*records[:9], {"prompt": "other"}]
    changed = PromptDataSource(10, 4, seed=3, digest=records_digest(edited))
    assert [m.split(":")[0] for m in changed.resume_mismatches(state, 5)] == ["digest"]
    assert [m.split(":")[0] for m in PromptDataSource(10, 8, seed=4).resume_mismatches(state, 5)] == [
        "epoch",
        "batch_size",
        "seed",
        "digest",
    ]


def test_image_paths_resolve_relative_to_the_file(tmp_path):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(b"x")
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "p", "image": "img/a.png", "metadata": {"k": 1}}])
    [record] = read_jsonl_records(path, input_key="prompt", metadata_key="metadata", image_key="image")
    assert record == {"prompt": "p", "metadata": {"k": 1}, "image": str(tmp_path / "img" / "a.png")}


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"prompt": "ok", "image": "a.png"}, "{not json"], r"d\.jsonl:2: not valid JSON"),
        (
            [{"text": "x", "image": "a.png"}],
            r"d\.jsonl:1: missing string field 'prompt' \(--input-key\); fields: 'text', 'image'$",
        ),
        ([{"prompt": 3}], r"d\.jsonl:1: missing string field 'prompt' \(--input-key\); it is int$"),
        ([{"prompt": "x", "image": "missing.png"}], r"d\.jsonl:1: image .*missing\.png not found"),
        ([], r"d\.jsonl:1: no records \(the file is empty\)"),
        (["", "  "], r"d\.jsonl:2: no records \(its 2 line\(s\) are blank\)"),
        ([{"prompt": "x", "image": "a.png", "metadata": [1]}], r"d\.jsonl:1: field 'metadata' .* must be an object"),
    ],
)
def test_bad_prompt_files_name_file_and_line(tmp_path, rows, message):
    (tmp_path / "a.png").write_bytes(b"x")
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(PromptDataError, match=message):
        read_jsonl_records(path, input_key="prompt", metadata_key="metadata", image_key="image")


def test_missing_file_is_named_with_the_flag_that_named_it(tmp_path):
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(PromptDataError, match="^--prompt-data .*nope.jsonl: file not found"):
        read_jsonl_records(missing, input_key="prompt", metadata_key="metadata")
    with pytest.raises(PromptDataError, match="^--eval-prompt-data .*nope.jsonl: file not found"):  # not --prompt-data
        read_prompt_file(missing, default_args(), flag="--eval-prompt-data")


def test_undecodable_bytes_name_file_line_and_byte(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(PromptDataError, match=r"d\.jsonl:2: not UTF-8 \(byte 0xe9 at column 16\)"):
        read_jsonl_records(str(path), input_key="prompt", metadata_key="metadata")


def test_fewer_distinct_prompts_than_a_rollout_needs_is_refused_unless_allowed(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a"}, {"prompt": "b"}, {"prompt": "a"}])
    records = read_jsonl_records(path, input_key="prompt", metadata_key="metadata")
    args = default_args(rollout_batch_size=3, allow_repeated_prompts=False)
    with pytest.raises(PromptDataError, match=r"2 distinct prompt\(s\), fewer than --rollout-batch-size 3.*"
                       r"--allow-repeated-prompts"):  # fmt: skip
        check_distinct_prompts(records, args, path)
    check_distinct_prompts(records, default_args(rollout_batch_size=2, allow_repeated_prompts=False), path)
    check_distinct_prompts(records, default_args(rollout_batch_size=4, allow_repeated_prompts=True), path)
