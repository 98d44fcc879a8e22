"""The dpo rollout side: online pairs (best vs worst of each prompt group, ties, zero-spread groups dropped with
weight 0 or kept), the preference file's validation errors (file and line, before any actor starts) and its pairs
encoded with the family's VAE (chosen and rejected rows from the right images)."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from miles.algorithms.dpo import PreferenceDataError, read_preference_file
from miles.models.conditioning import Conditioning
from miles.rollout.rollout_hub import DatasetSpec, get_rollout_spec, rollout_spec_of
from miles.rollout.rollout_hub.dpo import online_pairs, preference_records
from miles.utils.arg_rules import ArgumentError, validate_args
from miles.utils.arguments import parse_args
from miles.utils.types import Sample

GROUP = 4


def rollout(rewards_by_group, removed=()):
    samples, latents = [], []
    for g, rewards in enumerate(rewards_by_group):
        for r in rewards:
            index = len(samples)
            samples.append(Sample(index=index, prompt=f"p{g}", group_index=g, reward=r, remove_sample=index in removed))
            latents.append(torch.full((2, 2, 2), float(index)))  # latent i holds the value i
    result = SimpleNamespace(
        final_latents=torch.stack(latents),
        conditioning=Conditioning({"pooled_prompt_embeds": torch.arange(len(samples), dtype=torch.float32)[:, None]}),
    )
    return samples, result


def pair_of(pairs, row):
    return int(pairs["x0_w"][row, 0, 0, 0]), int(pairs["x0_l"][row, 0, 0, 0]), float(pairs["weight"][row])


@pytest.mark.parametrize("keep", [False, True])
def test_online_pairs_are_best_vs_worst_per_group_with_ties_and_zero_spread(keep):
    args = SimpleNamespace(dpo_keep_zero_spread=keep)
    groups = [[0.1, 0.9, 0.4, 0.2], [0.5, 0.9, 0.9, 0.1], [0.3, 0.3, 0.3, 0.3]]
    samples, result = rollout(groups)
    pairs = online_pairs(args, samples, result, torch.zeros(12), rollout_id=0)
    assert all(v.shape[0] == 12 for v in pairs.values())  # one row per sample: the batch invariant's count
    for row in range(12):
        expected = [(1, 0, 1.0), (5, 7, 1.0), (8, 11, float(keep))][row // GROUP]  # first highest, last lowest
        assert pair_of(pairs, row) == expected
    assert pairs["reward_gap"].tolist() == pytest.approx([0.8] * 4 + [0.8] * 4 + [0.0] * 4)
    assert torch.equal(pairs["cond/pooled_prompt_embeds"][:, 0], torch.arange(12, dtype=torch.float32))


def test_a_removed_sample_is_no_candidate():
    samples, result = rollout([[0.1, 0.9, 0.4, 0.2]], removed={1})
    pairs = online_pairs(SimpleNamespace(dpo_keep_zero_spread=False), samples, result, torch.zeros(4), rollout_id=0)
    assert pair_of(pairs, 0) == (2, 0, 1.0)


def write_image(path, value=0):
    Image.fromarray(np.full((8, 8, 3), value, dtype=np.uint8)).save(path)


def write_file(tmp_path, rows):
    path = tmp_path / "prefs.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def good(**overrides):
    return {"prompt": "a red circle", "image_0": "a.png", "image_1": "b.png", "preferred": 1, **overrides}


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"prompt": "x", "image_0": "a.png", "preferred": 0}, r"prefs.jsonl:2: missing key\(s\) 'image_1'"),
        (good(image_1="nowhere.png"), r"prefs.jsonl:2: image_1 .*nowhere.png not found"),
        (good(image_0="broken.png"), r"prefs.jsonl:2: image_0 .*broken.png is not a readable image"),
        (good(preferred=2), r"prefs.jsonl:2: 'preferred' must be 0 or 1 .*got 2"),
        (good(preferred=True), r"prefs.jsonl:2: 'preferred' must be 0 or 1 .*got true"),
        (good(prompt=""), r"prefs.jsonl:2: 'prompt' must be a non-empty string"),
        ("{not json", r"prefs.jsonl:2: not valid JSON"),
    ],
)
def test_a_bad_preference_record_names_the_file_and_line(tmp_path, row, message):
    write_image(tmp_path / "a.png")
    write_image(tmp_path / "b.png", 255)
    (tmp_path / "broken.png").write_bytes(b"not an image")
    path = write_file(tmp_path, [good(), row])
    with pytest.raises(PreferenceDataError, match=message) as caught:
        read_preference_file(str(path))
    assert "--dpo-preference-data" in str(caught.value) or "JSON object" in str(caught.value)


def test_preference_records_resolve_paths_and_the_preferred_image(tmp_path):
    (tmp_path / "imgs").mkdir()
    for name in ("a.png", "b.png"):
        write_image(tmp_path / "imgs" / name)
    path = write_file(
        tmp_path,
        [
            good(image_0="imgs/a.png", image_1="imgs/b.png"),
            "",
            good(image_0="imgs/a.png", image_1="imgs/b.png", preferred=0),
        ],
    )
    first, second = read_preference_file(str(path))
    assert (first.chosen, first.rejected) == (str(tmp_path / "imgs/b.png"), str(tmp_path / "imgs/a.png"))
    assert (second.chosen, second.rejected) == (str(tmp_path / "imgs/a.png"), str(tmp_path / "imgs/b.png"))
    records = preference_records(SimpleNamespace(dpo_preference_data=str(path)), resolution=8)
    assert [r["image"] for r in records] == [first.chosen, second.chosen]
    with pytest.raises(PreferenceDataError, match="no records"):
        read_preference_file(str(write_file(tmp_path, [""])))


def dpo_args(*extra):
    return parse_args(["--loss-type", "dpo", "--hf-checkpoint", "builtin:tiny-shapes", *extra], validate=False)


def test_the_rules_pair_train_only_with_the_preference_file_and_read_it_at_parse_time(tmp_path):
    write_image(tmp_path / "a.png")
    path = write_file(tmp_path, [good(image_1="a.png")] * 3 + [good(image_1="gone.png")])
    with pytest.raises(ArgumentError, match="prefs.jsonl:4: image_1 .*gone.png not found"):
        validate_args(dpo_args("--train-only", "--dpo-preference-data", str(path), "--rollout-batch-size", "2"))
    with pytest.raises(ArgumentError, match="--dpo-preference-data trains offline .*pass --train-only"):
        validate_args(dpo_args("--dpo-preference-data", str(path)))
    with pytest.raises(ArgumentError, match="--train-only trains on preference pairs: pass --dpo-preference-data"):
        validate_args(dpo_args("--train-only"))
    with pytest.raises(ArgumentError, match="--n-samples-per-prompt ≥ 2"):
        validate_args(dpo_args("--n-samples-per-prompt", "1", "--rollout-batch-size", "8"))
    with pytest.raises(ArgumentError, match="only apply to --loss-type dpo"):
        validate_args(
            parse_args(
                ["--loss-type", "nft", "--hf-checkpoint", "builtin:tiny-shapes", "--dpo-keep-zero-spread"],
                validate=False,
            )
        )


def test_offline_runs_the_dataset_entry_and_online_the_engines():
    assert isinstance(rollout_spec_of(SimpleNamespace(loss_type="dpo", train_only=True)), DatasetSpec)
    assert rollout_spec_of(SimpleNamespace(loss_type="dpo", train_only=False)) is get_rollout_spec("dpo")


def test_preference_pairs_encode_the_chosen_and_the_rejected_image_of_each_record(tiny_pipeline_dir, tmp_path):
    from miles.models.base import get_train_pipeline_config
    from miles.rollout.rollout_hub.dataset import image_to_tensor

    for name, value in (("a.png", 0), ("b.png", 255), ("c.png", 90)):
        write_image(tmp_path / name, value)
    path = write_file(tmp_path, [good(), good(image_0="c.png", preferred=0)])  # chosen: b, then c
    family = get_train_pipeline_config(tiny_pipeline_dir)
    args = SimpleNamespace(dpo_preference_data=str(path))
    records = preference_records(args, resolution=32)
    pairs = get_rollout_spec("dpo").dataset.encode(args, family, records, resolution=32)
    assert pairs["weight"].tolist() == [1.0, 1.0] and all(v.shape[0] == 2 for v in pairs.values())
    with torch.no_grad():
        for row, (chosen, rejected) in enumerate([("b.png", "a.png"), ("c.png", "b.png")]):
            for key, name in (("x0_w", chosen), ("x0_l", rejected)):
                expected = family.encode_images(image_to_tensor(str(tmp_path / name), 32)[None]).float()
                torch.testing.assert_close(pairs[key][row : row + 1], expected)
