"""The records of an algorithm's rollout side (miles/rollout/rollout_hub/spec.py): what an engine-fed entry that
names only its request, conversion and pair count gets by default (no metrics, the deterministic ODE for the held-out
eval, --async-rollout refused, no --train-only dataset), and that an entry cannot be changed once declared."""

from __future__ import annotations

import dataclasses

import pytest

from miles.arguments.parser import default_args
from miles.rollout.rollout_hub.spec import DatasetSpec, RolloutSpec


def request(args, samples, *, rollout_id, resolution):
    raise AssertionError("not called")


def test_an_entry_declares_three_functions_and_gets_the_safe_defaults():
    spec = RolloutSpec(build_request=request, convert=request, pairs_per_sample=lambda args, req: 2)
    assert spec.pairs_per_sample(None, None) == 2 and spec.metrics(None) == {}
    assert spec.eval_sampler(default_args(diffusion_eval_num_steps=7)) == {"sde_type": "ode", "num_steps": 7}
    assert spec.stale_batch is None and spec.stale_batch_conflict(default_args()) is None  # --async-rollout refused
    assert spec.dataset is None  # --train-only refused
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.stale_batch = "anything"  # type: ignore[misc]


def test_a_dataset_entry_reads_prompt_data_unless_it_names_its_records():
    assert DatasetSpec(encode=request).records is None
    records = DatasetSpec(encode=request, records=lambda args, *, resolution: [{"prompt": "a"}]).records
    assert records is not None and records(None, resolution=32) == [{"prompt": "a"}]
