"""When a plan does not fit, the flag changes the planner tries (miles/plan/suggest.py): the trainer's ladder cheapest
first, the engines' (a prompt cache where `auto` keeps the text encoders, VAE tiling for a video family, smaller
micro-batches), which side of a plan overflows, and changes applied as the start-up hands them to the run."""

from __future__ import annotations

from miles.arguments.parser import parse_args
from miles.plan.command import resolve_plan_checkpoint
from miles.plan.suggest import Change, apply_changes, engine_ladder, over, trainer_ladder, with_changes


def test_the_trainers_ladder_is_cheapest_first_and_skips_what_the_run_already_does():
    flags = [c.flags for c in trainer_ladder(parse_args(["--micro-batch-size", "32"]))]
    assert flags == [
        "--gradient-checkpointing",
        "--micro-batch-size 8",
        "--micro-batch-size 1",
        "--use-lora",
        "--fsdp-cpu-offload",
    ]
    given = parse_args(["--micro-batch-size", "1", "--gradient-checkpointing", "on", "--use-lora", "--colocate"])
    assert trainer_ladder(given) == []
    lora = [c for c in trainer_ladder(parse_args(["--micro-batch-size", "2"])) if c.flags == "--use-lora"]
    assert lora == [Change("--use-lora", {"use_lora": True}, ("engine", "trainer"))]  # the engine re-plans too


def test_over_tells_the_trainers_gpus_from_the_engine_only_ones():
    report = {
        "usable_bytes": 100,
        "gpus": [
            {"roles": ["actor rank 0", "engine 0"], "peak_bytes": 90},  # colocated: a trainer GPU
            {"roles": ["engine 1"], "peak_bytes": 101},
        ],
    }
    assert over(report, engines=True) and not over(report, engines=False)
    report["gpus"][0]["peak_bytes"] = 101
    assert over(report, engines=False)


def test_changes_move_the_role_overrides_that_follow_and_keep_the_given_ones():
    args = parse_args(["--loss-type", "dmd2", "--critic-lr", "1e-5"])
    changed = with_changes(args, [Change("--micro-batch-size 8", {"micro_batch_size": 8})])
    assert (changed.micro_batch_size, changed.critic_micro_batch_size) == (8, 8)
    assert (args.micro_batch_size, args.critic_micro_batch_size) == (32, 32)  # with_changes copies
    given = parse_args(["--loss-type", "dmd2", "--critic-micro-batch-size", "2"])
    apply_changes(given, [Change("--micro-batch-size 8", {"micro_batch_size": 8})])
    assert (given.micro_batch_size, given.critic_micro_batch_size) == (8, 2)


def test_the_engines_first_fix_is_a_prompt_cache_where_auto_keeps_the_text_encoders(tmp_path):
    """SD3 encodes a prompt alone differently in the last bits, so `auto` keeps its text encoders; a folder frees
    them, and the planner offers it first (re-planned like the others); never when the user turned the cache off."""
    report = {"roles": {"engine": {"micro_batch": 8}}}
    args = parse_args(["--plan", "--output-dir", str(tmp_path)])
    args.hf_checkpoint = resolve_plan_checkpoint(args.hf_checkpoint)  # as make_plan hands it on
    flags = [c.flags for c in engine_ladder(args, report)]
    assert flags == [
        f"--prompt-cache {tmp_path / 'prompt_cache'}",
        "--rollout-micro-batch-size 2",
        "--rollout-micro-batch-size 1",
    ]
    off = parse_args(["--plan", "--prompt-cache", "off"])
    off.hf_checkpoint = args.hf_checkpoint
    assert [c.flags for c in engine_ladder(off, report)][0] == "--rollout-micro-batch-size 2"


def test_a_video_familys_engine_is_offered_vae_tiling(tiny_hunyuan_video15_dir):
    args = parse_args(["--plan", "--hf-checkpoint", str(tiny_hunyuan_video15_dir), "--prompt-cache", "off"])
    flags = [c.flags for c in engine_ladder(args, {"roles": {"engine": {"micro_batch": 1}}})]
    assert flags == ["--vae-tiling on"]
