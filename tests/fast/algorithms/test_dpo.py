"""The dpo declaration's rules and computed defaults, offline (a preference file with --train-only) and online
(rollout groups), on the values the parser hands them. The preference file's own format errors are tested with the
dpo rollout side (tests/fast/rollout/rollout_hub/test_dpo.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
from PIL import Image

from miles.algorithms.dpo import ONLINE_REF_UPDATE_INTERVAL, derive, offline, validate


def args(**values):
    defaults = {
        "dpo_preference_data": None,
        "train_only": False,
        "dpo_keep_zero_spread": False,
        "eval_interval": None,
        "rollout_batch_size": 2,
        "n_samples_per_prompt": 4,
        "dpo_ref_update_interval": None,
    }
    return SimpleNamespace(**{**defaults, **values})


def preference_file(tmp_path, pairs):
    Image.fromarray(np.zeros((4, 4, 3), dtype=np.uint8)).save(tmp_path / "a.png")
    row = {"prompt": "a red circle", "image_0": "a.png", "image_1": "a.png", "preferred": 0}
    path = tmp_path / "prefs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for _ in range(pairs)))
    return str(path)


def test_online_pairs_need_groups_of_two_and_take_the_online_refresh_interval():
    assert not offline(args()) and validate(args()) == []
    assert validate(args(n_samples_per_prompt=1)) == [
        "online DPO pairs the best and the worst sample of a prompt group: --n-samples-per-prompt ≥ 2"
    ]
    assert derive(args()) == {"dpo_ref_update_interval": ONLINE_REF_UPDATE_INTERVAL}
    assert derive(args(dpo_ref_update_interval=7)) == {}


def test_offline_pairs_take_one_sample_no_engine_eval_and_a_reference_that_never_moves(tmp_path):
    path = preference_file(tmp_path, 2)
    run = args(dpo_preference_data=path, train_only=True)
    assert offline(run) and validate(run) == []
    assert derive(run) == {"dpo_ref_update_interval": 0, "n_samples_per_prompt": 1, "eval_interval": 0}
    assert derive(args(dpo_preference_data=path, train_only=True, eval_interval=0, dpo_ref_update_interval=5)) == {
        "n_samples_per_prompt": 1
    }


def test_an_offline_run_refuses_what_only_online_runs_do_and_too_few_pairs(tmp_path):
    path = preference_file(tmp_path, 2)
    errors = validate(args(dpo_preference_data=path, train_only=True, dpo_keep_zero_spread=True, eval_interval=5))
    assert errors == [
        "--dpo-keep-zero-spread applies to online pairs (rollout groups), not to --dpo-preference-data",
        "offline DPO starts no engine to evaluate with: drop --eval-interval (or pass 0)",
    ]
    assert validate(args(dpo_preference_data=path, train_only=True, rollout_batch_size=3)) == [
        f"--dpo-preference-data {path}: 2 pair(s), fewer than --rollout-batch-size 3"
    ]
    missing = str(tmp_path / "gone.jsonl")
    assert validate(args(dpo_preference_data=missing, train_only=True)) == [
        f"--dpo-preference-data {missing}: file not found"
    ]
