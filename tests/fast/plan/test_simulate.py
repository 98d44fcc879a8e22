"""The simulated processes (miles/plan/engine_sim.py, simulate.py): the counts against a hand count, the prediction against the same steps on real tensors, the engine's prompt-cache fill."""

from __future__ import annotations

import math

import pytest

from miles.models.base import family_options, get_train_pipeline_config
from miles.plan import engine_sim
from miles.plan import run as run_module
from miles.plan import simulate as simulate_module
from miles.plan.engine_sim import simulate_engine
from miles.plan.process import simulation_args
from miles.plan.simulate import simulate_trainer_rank
from miles.rollout.rollout_hub.spec import RolloutSpec
from tests.fast.plan.plan_cases import plan_args


def test_counts_match_a_hand_count_of_shards_and_adamw_states(dp2):
    """Rank 0's fp32 master shards, gradients and AdamW moments (plus one fp32 step counter per tensor) from the
    transformer's own parameter shapes, FSDP2 splitting dim 0 in chunks of ceil(rows / 2); nft's `old` shadow
    holds one more copy of the shards."""
    args, simulation = dp2
    family = get_train_pipeline_config(args.hf_checkpoint, args.model_family, **family_options(args))
    transformer = family.load_transformer(empty=True)
    shards = [math.ceil(p.shape[0] / 2) * p[0].numel() if p.dim() else p.numel() for p in transformer.parameters()]
    rank0 = simulation.roles["actor"][0]
    assert rank0.params_bytes == 4 * sum(shards)
    assert rank0.grads_bytes == 4 * sum(shards)
    assert rank0.optimizer_bytes == 4 * (2 * sum(shards) + len(shards))
    assert rank0.other_state_bytes == rank0.params_bytes
    assert rank0.peaks["train"] > rank0.params_bytes + rank0.grads_bytes + rank0.optimizer_bytes


def test_the_plan_predicts_the_same_steps_run_on_real_tensors():
    """World size 1: the trainer's start-up and window on pairs from the engine, on fake tensors and then for real,
    tracked alike: the start-up and window peaks agree within 1%. (Not the export: on a CPU its device-to-host copies
    alias; nor the engine, whose real weights come memory-mapped from their files, outside the dispatcher: both are
    compared with the whole process's RSS in docs/user-guide/memory.md.)"""
    args = simulation_args(plan_args("--diffusion-forward-dtype", "fp32", "--device", "cpu"))  # the device it runs on
    peaks = {}
    for fake in (True, False):
        engine, result, samples, _ = simulate_engine(args, 2, fake=fake)
        pairs = simulate_module.train_pairs_for_rank(args, samples, result)
        trainer, _ = simulate_trainer_rank(args, "actor", 0, 1, pairs, fake=fake)
        peaks[fake] = (trainer.peaks["start-up"], trainer.peaks["train"])
    for predicted, measured in zip(peaks[True], peaks[False]):
        assert predicted == pytest.approx(measured, rel=0.01)


def test_the_engine_frees_its_text_encoders_after_the_prompt_cache_fill_as_a_run_does(tiny_flux_dev_dir):
    """FLUX's encodings are cache-exact: with the prompt cache on (auto) the engine encodes at start-up, frees its
    text encoders and generates without them; with it off they stay resident for the whole run."""
    plans = {}
    for cache in ("auto", "off"):
        args = simulation_args(plan_args("--hf-checkpoint", str(tiny_flux_dev_dir), "--prompt-cache", cache))
        plans[cache], *_ = simulate_engine(args, 2)
    freed = plans["off"].params_bytes - plans["auto"].params_bytes  # the text encoders
    assert freed > 0
    assert plans["auto"].peaks["generate"] <= plans["off"].peaks["generate"] - freed
    assert plans["auto"].peaks["start-up"] >= plans["off"].params_bytes  # loaded for the fill


def test_the_train_peak_is_a_later_windows_with_adamw_moments_beside_the_forwards():
    """The first window's forwards and backwards run before AdamW allocates its moments; every later window runs
    them beside the moments (and a later micro-batch beside the first one's gradients). At 128 pixels the tiny
    model's activations outweigh its step, so the planned peak is the forward-backward one plus both."""
    args = simulation_args(
        plan_args("--micro-batch-size", "2", "--gradient-checkpointing", "off", "--resolution", "128")
    )
    engine, result, samples, _ = simulate_engine(args, 4)
    pairs = simulate_module.train_pairs_for_rank(args, samples, result)
    trainer, _ = simulate_trainer_rank(args, "actor", 0, 1, {k: v[:2] for k, v in pairs.items()})
    assert 0 < trainer.before_step_bytes <= trainer.peaks["train"]
    steady = trainer.before_step_bytes + trainer.optimizer_bytes + trainer.grads_bytes
    assert steady > trainer.peaks["train"]  # the first window's step peak is lower than this
    assert run_module.steady_train_peak(trainer, later_micro_batches=True) == steady
    alone = trainer.before_step_bytes + trainer.optimizer_bytes
    assert run_module.steady_train_peak(trainer, later_micro_batches=False) == max(alone, trainer.peaks["train"])


def test_the_planned_prompt_cache_fill_encodes_as_the_engines_fill_does(tmp_path, monkeypatch):
    """`PromptEncoder.fill` encodes a family whose prompts encode alone differently from a batch (SD3) one prompt at a
    time: so does the plan's start-up (encoding the whole rollout at once put Qwen-Image's engine at 91 GiB)."""
    args = simulation_args(plan_args("--prompt-cache", str(tmp_path / "cache")))
    family_class = type(get_train_pipeline_config(args.hf_checkpoint, args.model_family, **family_options(args)))
    batches = []
    original = family_class.encode_prompts

    def encode_prompts(self, prompts, *rest, **kwargs):
        batches.append(len(prompts))
        return original(self, prompts, *rest, **kwargs)

    monkeypatch.setattr(family_class, "encode_prompts", encode_prompts)
    simulate_engine(args, 6)  # groups of 2 samples: three prompts
    assert batches[:3] == [1, 1, 1] and set(batches) == {1}  # three prompts (then the negative, with CFG)


def test_a_run_on_dataset_pairs_is_refused_naming_why():
    """SFT trains on dataset pairs (--train-only, implied by its declaration): no engine call to simulate, so the
    planner says so instead of failing inside the simulation."""
    args = plan_args("--loss-type", "sft_loss", "--train-only")
    with pytest.raises(ValueError, match="--loss-type sft_loss with --train-only trains on dataset pairs"):
        engine_sim.engine_rollout_spec(args)
    assert isinstance(engine_sim.engine_rollout_spec(plan_args()), RolloutSpec)  # the default run's (nft)
