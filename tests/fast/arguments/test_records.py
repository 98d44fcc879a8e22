"""Flag records: each field is its flag's value in the parsed namespace; a field that names no flag, or a record
that is not a dataclass, is refused when the record is built, naming it."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from miles.arguments.parser import default_args, parse_args
from miles.arguments.records import FlagRecord, RolloutFlags


def test_the_rollout_record_at_the_defaults_holds_the_declared_defaults():
    flags = RolloutFlags.from_args(default_args())
    assert (flags.hf_checkpoint, flags.model_family, flags.resolution) == ("builtin:tiny-shapes", "auto", None)
    assert (flags.rollout_batch_size, flags.n_samples_per_prompt, flags.rollout_seed) == (8, 8, 42)
    assert (flags.rm_type, flags.custom_rm_path, flags.rm_url, flags.rm_num_workers) == (None, None, None, 0)
    assert (flags.load_debug_rollout_data, flags.save_debug_rollout_data, flags.generate_chunk_size) == (None, None, 0)
    assert (flags.rollout_micro_batch_size, flags.no_rollout_shuffle, flags.use_lora) == ("auto", False, False)


def test_the_rollout_record_holds_the_values_set_and_derived(tmp_path):
    args = parse_args(
        [
            "--hf-checkpoint", "unused", "--loss-type", "policy_loss", "--rollout-batch-size", "4",
            "--n-samples-per-prompt", "3", "--rollout-seed", "7", "--no-rollout-shuffle", "--rollout-micro-batch-size",
            "2", "--rm-url", "http://a:1", "--rm-url", "http://b:2", "--generate-chunk-size", "6",
            "--negative-prompt", "blurry", "--save-debug-rollout-data", str(tmp_path), "--media-max-samples", "1",
        ]
    )  # fmt: skip
    flags = RolloutFlags.from_args(args)
    assert (flags.rollout_batch_size, flags.n_samples_per_prompt, flags.rollout_seed) == (4, 3, 7)
    assert (flags.no_rollout_shuffle, flags.rollout_micro_batch_size, flags.generate_chunk_size) == (True, 2, 6)
    assert flags.rm_url == ["http://a:1", "http://b:2"] and flags.negative_prompt == "blurry"
    assert (flags.save_debug_rollout_data, flags.media_max_samples) == (str(tmp_path), 1)
    assert flags.diffusion_forward_dtype == args.diffusion_forward_dtype != "auto"  # the computed default, resolved
    assert pickle.loads(pickle.dumps(flags)) == flags  # what crosses into a Ray actor
    with pytest.raises(dataclasses.FrozenInstanceError):
        flags.rollout_seed = 8  # type: ignore[misc]  # the point: a record is read-only


def test_a_field_that_names_no_flag_is_refused_naming_it():
    @dataclasses.dataclass(frozen=True)
    class Misnamed(FlagRecord):
        dp_size: int
        dp_sise: int

    with pytest.raises(AttributeError, match=r"Misnamed.from_args: the namespace has no flag dp_sise"):
        Misnamed.from_args(default_args())


def test_a_record_must_be_a_dataclass():
    class Plain(FlagRecord):
        dp_size: int

    with pytest.raises(TypeError, match=r"Plain is a FlagRecord but not a dataclass"):
        Plain.from_args(default_args())
