"""The planner (`--plan`, miles/plan/) on the shipped tiny model: its counts against a hand count, its prediction
against the same steps run on real tensors, a planted rank-dependent collective caught, the start-up refusal."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from miles.arguments.parser import parse_args
from miles.models.base import family_options, get_train_pipeline_config
from miles.plan import simulate as simulate_module
from miles.plan.command import make_plan, plan_settings, resolve_plan_checkpoint
from miles.plan.report import build_report
from miles.plan.run import CollectiveMismatch, check_collectives, simulate
from miles.plan.simulate import PlannedTrainer, simulate_engine, simulate_trainer_rank, simulation_args
from miles.plan.startup import PlanDoesNotFit, check_plan

SMALL = ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--eval-interval", "0"]


def plan_args(*flags: str):
    args = parse_args(["--plan", *SMALL, *flags])
    args.hf_checkpoint = resolve_plan_checkpoint(args.hf_checkpoint)
    return args


@pytest.fixture(scope="module")
def dp2():
    """The default run (nft, full fine-tuning) at --dp-size 2 planned once: its args and simulation."""
    args = plan_args("--dp-size", "2")
    return args, simulate(args)


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


def test_ranks_issue_the_same_collectives_and_rank_0_gathers_for_the_engines(dp2):
    args, simulation = dp2
    first, last = simulation.roles["actor"]
    assert (first.rank, last.rank) == (0, 1)
    check_collectives(simulation)
    assert [c.op for c in first.collectives if c.phase == "train"]
    assert first.export_bytes > 0 and last.export_bytes == 0
    # a CUDA plan: rank 0 holds two bucket buffers of the weight sync for the whole run (the tiny model fits one
    # bucket: a buffer of its own size, tensors aligned), an engine apart one
    assert first.sync_buffer_bytes == pytest.approx(2 * first.export_bytes, rel=0.01) and last.sync_buffer_bytes == 0
    assert first.peaks["train"] >= first.sync_buffer_bytes + first.params_bytes
    report = build_report(args, simulation, plan_settings(args))
    assert report["roles"]["engine"]["sync_buffer_bytes"] == first.sync_buffer_bytes // 2


def test_planted_rank_dependent_collective_is_caught(monkeypatch):
    """A rank that issues one more all-reduce than rank 0 (the hang class): the plan fails naming both ranks."""
    original = PlannedTrainer._check_same_schedule_on_all_ranks

    def uneven(self, schedule):
        original(self, schedule)
        if self.rank != 0:
            dist.all_reduce(torch.zeros(3))

    monkeypatch.setattr(PlannedTrainer, "_check_same_schedule_on_all_ranks", uneven)
    args = plan_args("--dp-size", "2")
    with pytest.raises(CollectiveMismatch, match=r"actor rank 0 and rank 1 diverge .*allreduce"):
        check_collectives(simulate(args))


def test_the_plan_predicts_the_same_steps_run_on_real_tensors():
    """World size 1: the trainer's start-up and window on pairs from the engine, on fake tensors and then for real,
    tracked alike: the start-up and window peaks agree within 1%. (Not the export: on a CPU its device-to-host copies
    alias; nor the engine, whose real weights come memory-mapped from their files, outside the dispatcher: both are
    compared with the whole process's RSS in docs/user-guide/memory.md.)"""
    args = simulation_args(plan_args("--diffusion-forward-dtype", "fp32"))
    peaks = {}
    for fake in (True, False):
        engine, result, samples, _ = simulate_engine(args, 2, fake=fake)
        pairs = simulate_module.train_pairs_for_rank(args, samples, result)
        trainer, _ = simulate_trainer_rank(args, "actor", 0, 1, pairs, fake=fake)
        peaks[fake] = (trainer.peaks["start-up"], trainer.peaks["train"])
    for predicted, measured in zip(peaks[True], peaks[False]):
        assert predicted == pytest.approx(measured, rel=0.01)


def test_startup_refuses_a_cuda_run_that_would_not_fit(monkeypatch):
    """--plan-gpu as a stated size (0.01 GiB): the refusal names the GPU, the role, the phase and what fits."""
    monkeypatch.setattr("miles.plan.suggest.MAX_REPLANS", 1)
    sizes = ["--micro-batch-size", "4", "--gradient-checkpointing", "off", "--rollout-micro-batch-size", "2"]
    args = parse_args([*SMALL, *sizes, "--plan-gpu", "0.01"])  # given sizes: no `auto` search (test_auto.py)
    args.device = "cuda"  # what a CUDA machine resolves --device auto to; the plan itself runs on the CPU
    with pytest.raises(PlanDoesNotFit, match=r"GPU \d+ \((actor rank 0|engine 0)[^)]*\) needs .* in (train|generate)"):
        check_plan(args)
    args.no_plan_check = True
    assert check_plan(args) is None


def test_an_unknown_hub_id_names_the_shipped_ones():
    with pytest.raises(ValueError, match="black-forest-labs/FLUX.1-dev"):
        make_plan(parse_args(["--plan", "--hf-checkpoint", "nobody/nothing"]))


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


def test_per_tensor_equivalents_give_diffusers_tensors_and_are_restored():
    """The planner's loop-free HunyuanVideo 1.5 VAE attention mask equals diffusers' own (values, dtype, size)."""
    from diffusers.models.autoencoders.autoencoder_kl_hunyuanvideo15 import HunyuanVideo15AttnBlock

    from miles.plan.fake import per_tensor_equivalents

    own = HunyuanVideo15AttnBlock.prepare_causal_attention_mask
    cases = [(3, 4, None, torch.float32), (5, 7, 2, torch.float32), (2, 3, None, torch.bfloat16)]
    expected = [own(n, hw, dtype, "cpu", batch_size=b) for n, hw, b, dtype in cases]
    with per_tensor_equivalents():
        assert HunyuanVideo15AttnBlock.prepare_causal_attention_mask is not own
        got = [HunyuanVideo15AttnBlock.prepare_causal_attention_mask(n, hw, d, "cpu", b) for n, hw, b, d in cases]
    assert HunyuanVideo15AttnBlock.prepare_causal_attention_mask is own
    for a, b in zip(expected, got):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_hybrid_sharding_simulates_a_rank_of_each_shard_group():
    """--dp-size 4 --fsdp-shard-size 2 (a 2-D mesh): rank 0, the last rank and the second group's first rank are
    each simulated from a clean state (forked before rank 0; torch keeps the meshes a simulation met) and issue the
    same collectives (a rank simulated after rank 0 in one process would find rank 0's mesh groups: it failed)."""
    sizes = ["--micro-batch-size", "4", "--gradient-checkpointing", "off", "--rollout-micro-batch-size", "2"]
    args = plan_args("--dp-size", "4", "--fsdp-shard-size", "2", *sizes)
    simulation = simulate(args)
    assert [plan.rank for plan in simulation.roles["actor"]] == [0, 3, 2]
    check_collectives(simulation)
