import json

import pytest

from miles.rollout.data_source import PromptDataError, PromptDataSource, read_jsonl_records, records_digest


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
        ([{"text": "x"}], r"d\.jsonl:1: missing string field 'prompt'"),
        ([{"prompt": "x", "image": "missing.png"}], r"d\.jsonl:1: image .*missing\.png not found"),
        ([], "empty"),
    ],
)
def test_bad_prompt_files_name_file_and_line(tmp_path, rows, message):
    (tmp_path / "a.png").write_bytes(b"x")
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(PromptDataError, match=message):
        read_jsonl_records(path, input_key="prompt", metadata_key="metadata", image_key="image")


def test_missing_file_is_named(tmp_path):
    with pytest.raises(PromptDataError, match="nope.jsonl: file not found"):
        read_jsonl_records(str(tmp_path / "nope.jsonl"), input_key="prompt", metadata_key="metadata")
