"""Whole-loop throughput, side by side in one run: a plain single-process loop vs miles' driver, with the colocated
CPU phases (`--cpu-phase-threads auto`, the default), without them (`off`: each actor keeps its Ray share), with
generation overlapping training (`--async-rollout`: rollout k+1 generates while k trains), and with compiled
transformer blocks in the trainer and the engine (`--compile blocks`, otherwise the `auto` side).

Every side runs the same Flow-GRPO rollouts (default settings: 8 prompts x 8 samples, 10 steps, 2 trained SDE
steps) with the same model:

- plain loop: one process with all the machine's cores, no Ray: miles' own rollout steps with the engine in
  process, then a plain AdamW loop over the same micro-batches with the same loss hooks, then a state-dict copy
  into the engine.
- miles (dp 2, 1 engine by default): `train_diffusion.run` on a local Ray cluster, the flags as given.

Reported per side, over the timed rollouts (the first rollout of each run is a warm-up):

- seconds per rollout and samples/s. A miles rollout is the driver's wait for its batch + train + weight sync from
  metrics.jsonl (`perf/generate_wait_s` with --async-rollout, where the generation itself, `perf/generate_total_s`,
  ran during the previous rollout's training and sync; the generation's time otherwise); the plain loop's is its
  wall time. An --async-rollout run has one more rollout at the end, not timed (its training overlaps no
  generation). The ratios to the plain loop, against the issue's targets (colocated >= 0.9x, overlap >= 1.2x).
- the start-up of each miles side (`perf/startup_s`, `train_diffusion.run`'s call to its first rollout; target 8 s).
- CPU busy cores per phase of the driver (wait for the batch / train / weight sync, and all three together): the CPU
  seconds that this process and all its descendants (Ray's GCS, raylet and workers: every actor) used in the phase,
  over the phase's wall seconds, read from /proc via psutil at each phase boundary. Other users' processes are not
  counted; a process that ends between two boundaries loses its CPU since the last one (actors live for the run).
- the compiled side's compile seconds (trainer rank 0 and engine, `perf/compile_s` / `perf/engine_compile_s`, in its
  warm-up rollout), and how many rollouts its per-rollout saving over the `auto` side takes to pay them back.

Runs are interleaved (plain, auto, off, async, plain, ...; each side first in turn) so that a noisy neighbour hits
every side.

    python benchmarks/bench_loop.py                        # 8 prompts x 8 samples, 3 timed rollouts, 2 repeats
    python benchmarks/bench_loop.py --rollouts 2 --repeats 1 --no-plain --sides async   # one side's path
    python benchmarks/bench_loop.py --rollouts 10 --repeats 3 --extra=--dp-size=1
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from miles.utils.console import WORKER_ENV  # noqa: E402

for name, value in WORKER_ENV.items():  # no loading bars from the plain loop's pipeline, as in Ray workers
    os.environ.setdefault(name, value)

import psutil  # noqa: E402
import torch  # noqa: E402

from miles.backends.fsdp_utils.fsdp import parse_dtype  # noqa: E402
from miles.backends.fsdp_utils.loss_hub import get_loss_hooks  # noqa: E402
from miles.backends.fsdp_utils.loss_hub.types import DiffusionLossContext, WindowMetrics  # noqa: E402
from miles.backends.fsdp_utils.microbatch import build_microbatch_schedule, pairs_in_window  # noqa: E402
from miles.backends.fsdp_utils.optim import build_optimizer  # noqa: E402
from miles.models.builtin import resolve_checkpoint  # noqa: E402
from miles.rollout.engine import DiffusionEngine  # noqa: E402
from miles.utils.arguments import parse_args  # noqa: E402
from miles.utils.types import num_pairs, shard_pairs, slice_pairs  # noqa: E402

PHASES = ("wait", "train", "sync")  # the driver's phases of a rollout (wait: for the batch, generated meanwhile)
STARTUP = "start"  # a miles run's start-up: `train_diffusion.run`'s call to its first rollout (not in "all")
SIDES = {  # side -> its miles flags (None: the plain loop)
    "plain loop": None,
    "miles (phase threads auto)": ["--cpu-phase-threads", "auto"],
    "miles (phase threads off)": ["--cpu-phase-threads", "off"],
    "miles (async rollout)": ["--async-rollout"],
    "miles (--compile blocks)": ["--cpu-phase-threads", "auto", "--compile", "blocks"],
}
SHORT = {"plain": "plain loop", "auto": "miles (phase threads auto)", "off": "miles (phase threads off)"}
SHORT["async"] = "miles (async rollout)"
SHORT["compile"] = "miles (--compile blocks)"

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


class CpuMeter:
    """CPU seconds and wall seconds per phase of this process and all its descendants (psutil over /proc).

    `mark(phase)` closes the phase under way (its CPU and wall seconds since the last mark are added to it) and
    starts `phase`; None starts nothing that is counted. Each process's last reading is kept, so a process that ended
    still counts up to it. The CPU is also kept per kind of process (`process_kind`: the driver, each actor class,
    Ray's own daemons), to show where a phase's CPU went.
    """

    def __init__(self) -> None:
        self.root = psutil.Process()
        self.readings: dict[tuple[int, float], float] = {}  # (pid, create time) -> CPU seconds (user + system)
        self.kinds: dict[tuple[int, float], str] = {}  # (pid, create time) -> its kind, read once
        self.cpu = {phase: 0.0 for phase in (*PHASES, STARTUP)}
        self.wall = {phase: 0.0 for phase in (*PHASES, STARTUP)}
        self.by_kind: dict[str, dict[str, float]] = {phase: {} for phase in (*PHASES, STARTUP)}
        self.phase: str | None = None
        self.last = (time.perf_counter(), self.cpu_seconds(), self.kind_seconds())

    def cpu_seconds(self) -> float:
        for proc in [self.root, *self.root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):  # ended since the listing
                times = proc.cpu_times()
                key = (proc.pid, proc.create_time())
                self.readings[key] = times.user + times.system
                if key not in self.kinds:
                    self.kinds[key] = "driver" if proc.pid == self.root.pid else process_kind(proc.cmdline())
        return sum(self.readings.values())

    def kind_seconds(self) -> dict[str, float]:
        """CPU seconds per kind of process, as of the last reading."""
        out: dict[str, float] = {}
        for key, seconds in self.readings.items():
            out[self.kinds[key]] = out.get(self.kinds[key], 0.0) + seconds
        return out

    def mark(self, phase: str | None) -> None:
        now = (time.perf_counter(), self.cpu_seconds(), self.kind_seconds())
        if self.phase is not None:
            self.wall[self.phase] += now[0] - self.last[0]
            self.cpu[self.phase] += now[1] - self.last[1]
            kinds = self.by_kind[self.phase]
            for kind, seconds in now[2].items():
                kinds[kind] = kinds.get(kind, 0.0) + seconds - self.last[2].get(kind, 0.0)
        self.phase, self.last = phase, now

    def cores(self) -> dict[str, float]:
        """Busy cores per phase, over the loop's three ("all") and in the start-up."""
        out = {phase: self.cpu[phase] / self.wall[phase] if self.wall[phase] else 0.0 for phase in (*PHASES, STARTUP)}
        wall = sum(self.wall[phase] for phase in PHASES)
        out["all"] = sum(self.cpu[phase] for phase in PHASES) / wall if wall else 0.0
        return out

    def kind_cores(self, phase: str) -> dict[str, float]:
        """Busy cores of each kind of process in `phase`, largest first (kinds under 0.005 cores left out)."""
        wall = self.wall[phase]
        cores = {kind: seconds / wall for kind, seconds in self.by_kind[phase].items()} if wall else {}
        return dict(sorted(((k, v) for k, v in cores.items() if v >= 0.005), key=lambda kv: -kv[1]))


def process_kind(cmdline: list[str]) -> str:
    """A process's kind from its command line: a Ray worker's actor class ("ray::EngineActor", whatever method it
    runs now; "ray::IDLE" for a pooled worker), a Python script's file name (Ray's log monitor, dashboard agent, ...),
    or the program's name (raylet, gcs_server)."""
    if not cmdline:
        return "?"
    first = cmdline[0]
    if first.startswith("ray::"):
        return first.split(".", 1)[0].split()[0]
    if os.path.basename(first).startswith("python"):
        script = next((part for part in cmdline[1:] if part.endswith(".py")), None)
        if script is not None:
            return os.path.basename(script)
        return " ".join(cmdline[1:3])[:40] or "python"
    return os.path.basename(first.split()[0])


@contextlib.contextmanager
def driver_phases(meter: CpuMeter, timed: range) -> Iterator[None]:
    """Marks the phases of miles' driver on `meter`: the wait for rollout k's batch (`Generations.get`), its
    training (until the sync), the weight sync (`RolloutManager.update_weights`), for the rollouts in `timed` only;
    what follows a sync is not counted."""
    from miles.ray.generations import Generations
    from miles.ray.rollout_manager import RolloutManager

    get, update_weights = Generations.get, RolloutManager.update_weights

    def timed_get(self, rollout_id):
        if meter.phase == STARTUP:  # the first rollout starts: the start-up ends
            meter.mark(None)
        meter.mark("wait" if rollout_id in timed else None)
        result = get(self, rollout_id)
        meter.mark("train" if rollout_id in timed else None)
        return result

    def timed_update_weights(self, actor_group, *args, **kwargs):
        meter.mark("sync" if meter.phase is not None else None)
        seconds = update_weights(self, actor_group, *args, **kwargs)
        meter.mark(None)
        return seconds

    Generations.get, RolloutManager.update_weights = timed_get, timed_update_weights
    try:
        yield
    finally:
        Generations.get, RolloutManager.update_weights = get, update_weights


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


def plain_loop(argv: list[str], rollouts: int, meter: CpuMeter) -> list[float]:
    """Seconds of each rollout (generate, score, convert, train, copy weights) in one process, no Ray; the phases
    after the first rollout (the warm-up) go on `meter`."""
    import miles.ray.rollout_manager as rollout_manager  # its RolloutEngineGroup name is what __init__ calls
    from miles.ray.rollout_manager import RolloutManager

    args = parse_args([*argv, "--rm-num-workers", "0"])
    args.hf_checkpoint = resolve_checkpoint(args.hf_checkpoint)
    torch.set_num_threads(os.cpu_count() or 1)
    saved, rollout_manager.RolloutEngineGroup = rollout_manager.RolloutEngineGroup, InProcessEngines
    try:
        manager = RolloutManager(args)
    finally:
        rollout_manager.RolloutEngineGroup = saved
    engine = manager.engines.engine
    family, hooks = manager.family, get_loss_hooks(args, "actor")
    model = family.load_transformer(args.hf_checkpoint, dtype=torch.float32)
    model.train()
    optimizer = build_optimizer(model.parameters(), args, args.lr)
    dtype = parse_dtype(args.diffusion_forward_dtype)
    seconds = []
    for rollout_id in range(rollouts):
        started = time.perf_counter()
        meter.mark("wait" if rollout_id > 0 else None)
        pairs = shard_pairs(manager._rl_rollout(rollout_id), 1)[0]  # with pair_index, as a rank receives them
        meter.mark("train" if rollout_id > 0 else None)
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
                prepared = hooks.prepare(
                    ctx, batch, microbatch_id=mb.microbatch_id, optim_step_idx=step, pad_to_len=None
                )
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
                    frozen_preds={},
                    metrics=WindowMetrics(),
                    optim_step_idx=step,
                    train_output_inputs=[],
                )
                (loss / pairs_in_window(window)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
            optimizer.step()
        meter.mark("sync" if rollout_id > 0 else None)
        engine.update_weights(model.state_dict(), rollout_id)
        meter.mark(None)
        seconds.append(time.perf_counter() - started)
    return seconds


def miles_run(argv: list[str], rollouts: int, out: str, meter: CpuMeter) -> tuple[float, list[dict], float]:
    """`train_diffusion.run` on its own local Ray cluster: a warm-up rollout, then `rollouts` timed ones (their
    phases on `meter`), with --async-rollout then one more, not timed: its training has no next generation to overlap
    (the pipeline drains), so the timed rollouts hold as many generations as trainings. Returns the start-up seconds
    and the timed rollouts' records, and the seconds the trainer's rank 0 and the engine spent compiling (0 without
    --compile)."""
    import train_diffusion
    from miles.utils.tracking import read_metrics

    extra = 2 if "--async-rollout" in argv else 1
    args = parse_args([*argv, "--num-rollout", str(rollouts + extra), "--output-dir", out])  # the last one counts
    with driver_phases(meter, range(1, rollouts + 1)):
        meter.mark(STARTUP)
        train_diffusion.run(args)
    metrics = read_metrics(os.path.join(out, "metrics.jsonl"))
    records = [r for r in metrics if "perf/generate_total_s" in r]
    compile_s = max((r.get("perf/compile_s", 0.0) for r in metrics), default=0.0)
    compile_s += max((r.get("perf/engine_compile_s", 0.0) for r in records), default=0.0)
    return records[0]["perf/startup_s"], records[1 : rollouts + 1], compile_s


def rollout_seconds(record: dict) -> float:
    """A miles rollout's seconds: the driver's wait for the batch (the generation itself unless it ran ahead, with
    --async-rollout), training and weight sync."""
    wait = record.get("perf/generate_wait_s", record["perf/generate_total_s"])
    return wait + record["perf/train_s"] + record["perf/weight_sync_s"]


def parse_options(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=3, help="timed rollouts per run (after one warm-up)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each side, interleaved")
    parser.add_argument("--no-plain", action="store_true", help="miles' sides only")
    parser.add_argument(
        "--sides",
        default="auto,off,async,compile",
        help="miles' sides, comma-separated from auto, off, async, compile (default all)",
    )
    parser.add_argument("--extra", action="append", default=[], help="more miles flags, e.g. --extra=--dp-size=1")
    opts = parser.parse_args(argv)
    names = [name.strip() for name in opts.sides.split(",") if name.strip()]
    unknown = [name for name in names if name not in SHORT or name == "plain"]
    if unknown or not names:
        parser.error(f"--sides: unknown side(s) {unknown or opts.sides!r}; choose from auto, off, async, compile")
    if opts.rollouts < 1 or opts.repeats < 1:
        parser.error("--rollouts and --repeats must be >= 1")
    opts.sides = ([] if opts.no_plain else ["plain loop"]) + [SHORT[name] for name in names]
    return opts


def main(argv: list[str] | None = None) -> dict:
    opts = parse_options(argv)
    extra = [part for flag in opts.extra for part in flag.split("=", 1)]
    argv = [*BASE, *extra, "--num-rollout", str(opts.rollouts + 1)]
    probe = parse_args(argv)
    samples = probe.rollout_batch_size * probe.n_samples_per_prompt
    seconds: dict[str, list[float]] = {name: [] for name in opts.sides}
    records: dict[str, list[dict]] = {name: [] for name in opts.sides}
    startup: dict[str, list[float]] = {name: [] for name in opts.sides}
    compile_s: dict[str, list[float]] = {name: [] for name in opts.sides}
    meters = {name: CpuMeter() for name in opts.sides}
    for repeat in range(opts.repeats):
        shift = repeat % len(opts.sides)  # each side goes first in turn: a neighbour's load drifting hits every side
        for name in opts.sides[shift:] + opts.sides[:shift]:
            if SIDES[name] is None:
                seconds[name] += plain_loop(argv, opts.rollouts + 1, meters[name])[1:]
                continue
            with tempfile.TemporaryDirectory() as out:
                startup_s, timed, compiled_s = miles_run([*argv, *SIDES[name]], opts.rollouts, out, meters[name])
            startup[name].append(startup_s)
            compile_s[name].append(compiled_s)
            records[name] += timed
            seconds[name] += [rollout_seconds(r) for r in timed]
    print(f"{samples} samples per rollout, {opts.rollouts} timed rollouts x {opts.repeats} runs per side")
    print(
        f"{'side':<28}{'s/rollout':>10}{'samples/s':>10}{'wait':>7}{'gen':>7}{'train':>7}{'sync':>7}{'start':>7}"
        f"  busy cores: {'wait':>5}{'train':>6}{'sync':>6}{'all':>6}"
    )
    results: dict[str, dict] = {}
    for name in opts.sides:
        median = statistics.median(seconds[name])
        row = {"s_per_rollout": median, "samples_per_s": samples / median, "cores": meters[name].cores()}
        row["cores_by_process"] = {phase: meters[name].kind_cores(phase) for phase in (*PHASES, STARTUP)}
        if records[name]:
            rs = records[name]
            row["wait_s"] = statistics.median(r.get("perf/generate_wait_s", r["perf/generate_total_s"]) for r in rs)
            row["generate_s"] = statistics.median(r["perf/generate_total_s"] for r in rs)
            row["train_s"] = statistics.median(r["perf/train_s"] for r in rs)
            row["sync_s"] = statistics.median(r["perf/weight_sync_s"] for r in rs)
            row["startup_s"] = statistics.median(startup[name])
        elif seconds[name]:  # the plain loop: its phases' mean wall seconds per timed rollout, from its meter
            for phase in PHASES:
                row[f"{phase}_s"] = meters[name].wall[phase] / len(seconds[name])
        results[name] = row
        phases = "".join(
            f"{row[k]:>7.2f}" if k in row else f"{'':>7}"
            for k in ("wait_s", "generate_s", "train_s", "sync_s", "startup_s")
        )
        cores = "".join(f"{row['cores'][k]:>6.2f}" for k in (*PHASES, "all"))
        print(f"{name:<28}{median:>10.2f}{row['samples_per_s']:>10.1f}{phases}  busy cores:{cores}")
    print("busy cores by process, per phase (where each side's CPU went):")
    for name in opts.sides:
        for phase in (*PHASES, STARTUP):
            kinds = meters[name].kind_cores(phase)
            if kinds:
                shown = ", ".join(f"{kind} {cores:.2f}" for kind, cores in kinds.items())
                print(f"  {name:<26} {phase:<5} {shown}")
    targets = {"miles (phase threads auto)": 0.9, "miles (async rollout)": 1.2, SHORT["compile"]: 1.15}
    rates = {name: row["samples_per_s"] for name, row in results.items()}
    if "plain loop" in rates:
        for name in rates:
            if name != "plain loop":
                target = f" (target >= {targets[name]})" if name in targets else ""
                print(f"ratio {name} / plain loop = {rates[name] / rates['plain loop']:.2f}{target}")
    for a, b in (("auto", "off"), ("async", "auto"), ("compile", "auto")):
        if SHORT[a] in rates and SHORT[b] in rates:
            print(f"ratio {a} / {b} = {rates[SHORT[a]] / rates[SHORT[b]]:.2f}")
    if SHORT["compile"] in rates and SHORT["auto"] in rates:  # the compile paid back by the per-rollout saving
        spent = statistics.median(compile_s[SHORT["compile"]])
        saved = results[SHORT["auto"]]["s_per_rollout"] - results[SHORT["compile"]]["s_per_rollout"]
        payback = f"{spent / saved:.0f} rollouts" if saved > 0 else "never (no saving per rollout)"
        print(f"compile: {spent:.1f} s per run (trainer rank 0 + engine, median), saving {saved:.2f} s per rollout: "
              f"paid back after {payback}")  # fmt: skip
    starts = {name: row["startup_s"] for name, row in results.items() if "startup_s" in row}
    if starts:
        print("start-up to the first rollout, median (target <= 8 s): " + ", ".join(
            f"{name} {value:.1f} s" for name, value in starts.items()))  # fmt: skip
    for name in starts:  # what the start-up costs in CPU: on a machine of C cores it takes at least CPU / C seconds
        meter, runs = meters[name], len(startup[name])
        kinds = {kind: seconds / runs for kind, seconds in meter.by_kind[STARTUP].items() if seconds / runs >= 0.05}
        shown = ", ".join(f"{kind} {seconds:.1f}" for kind, seconds in sorted(kinds.items(), key=lambda kv: -kv[1]))
        print(
            f"start-up of {name}: {meter.cpu[STARTUP] / runs:.1f} CPU s in {meter.wall[STARTUP] / runs:.1f} s per run "
            f"({meter.cores()[STARTUP]:.2f} busy cores): {shown}"
        )
    print(json.dumps({"samples_per_s": rates, "startup_s": starts}))
    return results


if __name__ == "__main__":
    main()
