"""Whole-loop throughput, side by side in one run: a plain single-process loop vs miles' driver, with the colocated
CPU phases (`--cpu-phase-threads auto`, the default) and without them (`off`: each actor keeps its Ray share).

Every side runs the same Flow-GRPO rollouts (default settings: 8 prompts x 8 samples, 10 steps, 2 trained SDE
steps) with the same model:

- plain loop: one process with all the machine's cores, no Ray: miles' own rollout steps with the engine in
  process, then a plain AdamW loop over the same micro-batches with the same loss hooks, then a state-dict copy
  into the engine.
- miles (dp 2, 1 engine by default): `train_diffusion.run` on a local Ray cluster, the flags as given.

Reported: samples/s over the timed rollouts (the first is a warm-up), the phase times of miles' runs, and the
ratios miles / plain. Runs are interleaved (plain, auto, off, plain, ...) so that a noisy neighbour hits every side.

    python benchmarks/bench_loop.py                        # 8 prompts x 8 samples, 3 timed rollouts, 2 repeats
    python benchmarks/bench_loop.py --rollouts 10 --repeats 3 --extra=--dp-size=1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from miles.utils.console import WORKER_ENV  # noqa: E402

for name, value in WORKER_ENV.items():  # no loading bars from the plain loop's pipeline, as in Ray workers
    os.environ.setdefault(name, value)

import torch  # noqa: E402

from miles.backends.fsdp_utils.fsdp import parse_dtype  # noqa: E402
from miles.backends.fsdp_utils.loss_hub import get_loss_hooks  # noqa: E402
from miles.backends.fsdp_utils.loss_hub.types import DiffusionLossContext, WindowMetrics  # noqa: E402
from miles.backends.fsdp_utils.microbatch import build_microbatch_schedule, pairs_in_window  # noqa: E402
from miles.backends.fsdp_utils.optim import build_optimizer  # noqa: E402
from miles.models.builtin import resolve_checkpoint  # noqa: E402
from miles.rollout.engine import DiffusionEngine  # noqa: E402
from miles.utils.arguments import parse_args  # noqa: E402
from miles.utils.types import num_pairs, slice_pairs  # noqa: E402

BASE = [
    "--loss-type",
    "policy_loss",
    "--hf-checkpoint",
    "builtin:tiny-shapes",
    "--prompt-data",
    "builtin:shapes",
    "--eval-interval",
    "0",
    "--image-grid-interval",
    "0",
    "--no-progress",
    "--log-level",
    "WARNING",
]


class InProcessEngines:
    """Stands in for `RolloutEngineGroup` in the plain loop: one `DiffusionEngine` in this process."""

    def __init__(self, hf_checkpoint: str, **kwargs) -> None:
        self.engine = DiffusionEngine(
            hf_checkpoint,
            model_family=kwargs.get("model_family", "auto"),
            forward_dtype=kwargs.get("forward_dtype", torch.float32),
        )

    def generate(self, request, rollout_id=None):
        return self.engine.generate(request)

    def wait_ready(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


def plain_loop(argv: list[str], rollouts: int) -> list[float]:
    """Seconds of each rollout (generate, score, convert, train, copy weights) in one process, no Ray."""
    import miles.ray.engine_group as engine_group
    from miles.ray.rollout_manager import RolloutManager

    args = parse_args([*argv, "--rm-num-workers", "0"])
    args.hf_checkpoint = resolve_checkpoint(args.hf_checkpoint)
    torch.set_num_threads(os.cpu_count() or 1)
    saved, engine_group.RolloutEngineGroup = engine_group.RolloutEngineGroup, InProcessEngines
    try:
        manager = RolloutManager(args)
    finally:
        engine_group.RolloutEngineGroup = saved
    engine = manager.engines.engine
    family, hooks = manager.family, get_loss_hooks(args, "actor")
    model = family.load_transformer(args.hf_checkpoint, dtype=torch.float32)
    model.train()
    optimizer = build_optimizer(model.parameters(), args, args.lr)
    dtype = parse_dtype(args.diffusion_forward_dtype)
    seconds = []
    for rollout_id in range(rollouts):
        started = time.perf_counter()
        pairs = manager._rl_rollout(rollout_id)
        ctx = DiffusionLossContext(
            args=args,
            role="actor",
            rollout_id=rollout_id,
            dp_rank=0,
            dp_size=1,
            device=torch.device("cpu"),
            forward_dtype=dtype,
            family=family,
            networks={"policy": model},
        )
        pairs = hooks.train_input(ctx, pairs)
        schedule = build_microbatch_schedule(num_pairs(pairs), args.num_steps_per_rollout, args.micro_batch_size)
        for step, window in enumerate(schedule):
            optimizer.zero_grad(set_to_none=True)
            for mb in window:
                batch = slice_pairs(pairs, mb.start, mb.end)
                prepared = hooks.prepare(ctx, batch, microbatch_id=mb.microbatch_id, optim_step_idx=step)
                velocity = family.predict_velocity(
                    model,
                    prepared.latents,
                    prepared.sigmas,
                    prepared.embeds,
                    guidance_scale=prepared.guidance_scale,
                    negative=prepared.negative,
                )
                loss = hooks.formula(
                    ctx,
                    batch,
                    prepared,
                    new_pred=velocity,
                    ref_pred=None,
                    frozen_preds={},
                    metrics=WindowMetrics(),
                    optim_step_idx=step,
                    train_output_inputs=[],
                )
                (loss / pairs_in_window(window)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
            optimizer.step()
        engine.update_weights(model.state_dict(), rollout_id)
        seconds.append(time.perf_counter() - started)
    return seconds


def miles_run(argv: list[str], out: str) -> list[dict]:
    """`train_diffusion.run` on its own local Ray cluster; its per-rollout records."""
    import train_diffusion
    from miles.utils.tracking import read_metrics

    args = parse_args([*argv, "--output-dir", out])
    train_diffusion.run(args)
    return [r for r in read_metrics(os.path.join(out, "metrics.jsonl")) if "perf/generate_total_s" in r]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=3, help="timed rollouts per run (after one warm-up)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each side, interleaved")
    parser.add_argument("--no-plain", action="store_true", help="miles' two sides only")
    parser.add_argument("--extra", action="append", default=[], help="more miles flags, e.g. --extra=--dp-size=1")
    opts = parser.parse_args()
    extra = [part for flag in opts.extra for part in flag.split("=", 1)]
    argv = [*BASE, *extra, "--num-rollout", str(opts.rollouts + 1)]
    probe = parse_args(argv)
    samples = probe.rollout_batch_size * probe.n_samples_per_prompt
    sides = {"plain loop": [], "miles (phase threads auto)": [], "miles (phase threads off)": []}
    phases: dict[str, list[dict]] = {name: [] for name in sides}
    order = [name for name in sides if not (opts.no_plain and name == "plain loop")]
    if opts.no_plain:
        del sides["plain loop"]
    for repeat in range(opts.repeats):
        shift = repeat % len(order)  # each side goes first in turn: a neighbour's load drifting hits every side
        for name in order[shift:] + order[:shift]:
            if name == "plain loop":
                sides[name] += plain_loop(argv, opts.rollouts + 1)[1:]
                continue
            mode = name.split()[-1].rstrip(")")
            with tempfile.TemporaryDirectory() as out:
                records = miles_run([*argv, "--cpu-phase-threads", mode], out)[1:]
            phases[name] += records
            sides[name] += [r["perf/generate_total_s"] + r["perf/train_s"] + r["perf/weight_sync_s"] for r in records]
    print(f"{samples} samples per rollout, {opts.rollouts} timed rollouts x {opts.repeats} runs per side")
    print(f"{'side':<30}{'s/rollout':>10}{'samples/s':>11}{'generate':>10}{'train':>8}{'sync':>8}")
    rates = {}
    for name, times in sides.items():
        median = statistics.median(times)
        rates[name] = samples / median
        parts = phases[name]
        cols = (
            [statistics.median(r[k] for r in parts) for k in ("perf/generate_total_s", "perf/train_s")]
            + [statistics.median(r["perf/weight_sync_s"] for r in parts)]
            if parts
            else []
        )
        print(
            f"{name:<30}{median:>10.2f}{rates[name]:>11.1f}"
            + "".join(f"{c:>10.2f}" for c in cols[:1])
            + "".join(f"{c:>8.2f}" for c in cols[1:])
        )
    if "plain loop" in rates:
        for name in list(sides)[1:]:
            print(f"ratio {name} / plain loop = {rates[name] / rates['plain loop']:.2f}")
    auto, off = rates["miles (phase threads auto)"], rates["miles (phase threads off)"]
    print(f"ratio phase threads auto / off = {auto / off:.2f}")
    print(json.dumps({"samples_per_s": rates}))


if __name__ == "__main__":
    main()
