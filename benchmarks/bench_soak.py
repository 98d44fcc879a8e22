"""Soak: a tiny configuration for several hundred rollouts, with saves and evals, while the resident memory and the
open files of every process of the run (the driver, Ray's GCS / raylet / helpers, every actor) are sampled over time.
A leak shows as a curve that keeps climbing after the warm-up; the run fails the bound below if it does.

    python benchmarks/bench_soak.py                          # 300 rollouts, save + eval every 25 (about 10 min)
    python benchmarks/bench_soak.py --rollouts 600 --out soak.json

What it runs: `train_diffusion.py` in a child process on the shipped tiny model (`--loss-type nft` unless
`--loss-type` is given, dp 2, 2 prompts x 4 samples, 4 steps, `--save-interval` / `--eval-interval` 25 on 16 held-out
prompts), so every phase a long run has (generate, score, train, weight sync, save, eval) repeats many times.

What it measures, every `--sample-s` seconds, for each process in the run's process tree (psutil): its resident set
(RSS) and its open file descriptors, labelled by role (the driver; `ray::ClassName` for an actor; the Ray process
name otherwise), plus the rollout the run has finished (from its metrics.jsonl). The baseline is the first sample
after `--warmup` rollouts (allocator pools, caches and the first checkpoint's buffers are filled by then); the end
is the last sample before the run exits.

The bound (documented in docs/user-guide/performance.md "Long runs"): from the baseline to the end,
- the whole tree's RSS grows by at most max(64 MiB, 5 % of the baseline),
- no single process's RSS grows by more than max(32 MiB, 10 % of its baseline),
- no process's open file descriptors grow by more than 8,
- and the tree's RSS over the last half of the run has a fitted slope below 16 MiB per 100 rollouts.
A process that starts or ends between the two points (a restart, a helper) is listed and not compared.
The curve goes to `--out` (JSON: one row per sample); the exit code is 1 when a bound is exceeded.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 2**20
TREE_GROWTH = (64 * MIB, 0.05)
PROCESS_GROWTH = (32 * MIB, 0.10)
FD_GROWTH = 8
SLOPE_PER_100 = 16 * MIB


def run_flags(opts: argparse.Namespace, workdir: str) -> list[str]:
    flags = [
        "--hf-checkpoint", "builtin:tiny-shapes", "--prompt-data", "builtin:shapes",
        "--loss-type", opts.loss_type, "--dp-size", str(opts.dp_size),
        "--num-rollout", str(opts.rollouts), "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
        "--diffusion-num-steps", "4", "--micro-batch-size", "2",
        "--save", os.path.join(workdir, "ckpt"), "--save-interval", str(opts.save_interval),
        "--eval-interval", str(opts.eval_interval), "--eval-num-prompts", "16", "--n-samples-per-eval-prompt", "1",
        "--image-grid-interval", "0", "--output-dir", os.path.join(workdir, "run"), "--no-progress",
        "--seed", "1", "--rollout-seed", "1",
    ]  # fmt: skip
    return flags + opts.extra


def label(proc: psutil.Process, driver_pid: int) -> str:
    """A stable name for a process of the run: the driver, `ray::Class` for an actor, else the executable's name."""
    if proc.pid == driver_pid:
        return "driver"
    try:
        cmd = proc.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return proc.name()
    if cmd and cmd[0].startswith("ray::"):
        return cmd[0].split(".")[0].split(" ")[0]  # "ray::TrainActor.train" -> "ray::TrainActor"
    if cmd and os.path.basename(cmd[0]).startswith("python"):  # a Ray helper script: its file's name
        script = next((part for part in cmd[1:] if not part.startswith("-")), cmd[0])
        return os.path.basename(script)
    return os.path.basename(cmd[0]) if cmd else proc.name()


def finished_rollout(metrics_path: str) -> int:
    """The highest rollout_id in metrics.jsonl so far (-1 before the first)."""
    try:
        with open(metrics_path) as f:
            ids = [json.loads(line).get("rollout_id", -1) for line in f if line.strip()]
    except (OSError, json.JSONDecodeError):
        return -1
    return max(ids, default=-1)


def sample(driver: psutil.Process, metrics_path: str, t0: float) -> dict:
    procs = {}
    for proc in [driver, *driver.children(recursive=True)]:
        try:
            with proc.oneshot():
                procs[proc.pid] = {
                    "label": label(proc, driver.pid),
                    "rss": proc.memory_info().rss,
                    "fds": proc.num_fds(),
                }
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return {"t": round(time.monotonic() - t0, 2), "rollout": finished_rollout(metrics_path), "procs": procs}


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of y over x (0 with fewer than two distinct x)."""
    if len({x for x, _ in points}) < 2:
        return 0.0
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    return sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)


def analyse(samples: list[dict], warmup: int) -> dict:
    after = [s for s in samples if s["rollout"] >= warmup]
    if len(after) < 2:
        raise SystemExit(f"bench_soak: fewer than two samples after the warm-up of {warmup} rollouts; run longer")
    start = after[0]
    # the end: the last sample that still holds every process of the baseline (the run's teardown comes after it)
    alive = lambda s, pid: pid in s["procs"] and s["procs"][pid]["rss"] > 0  # noqa: E731 - a dying one reads 0
    whole = [i for i, s in enumerate(after) if all(alive(s, pid) for pid in start["procs"])]
    after = after[: whole[-1] + 1]
    end = after[-1]
    rows, problems = [], []
    for pid, first in start["procs"].items():
        last = end["procs"].get(pid)
        if last is None:
            continue
        growth = last["rss"] - first["rss"]
        rows.append({"pid": pid, "label": first["label"], "rss_start": first["rss"], "rss_end": last["rss"],
                     "fds_start": first["fds"], "fds_end": last["fds"]})  # fmt: skip
        if growth > max(PROCESS_GROWTH[0], PROCESS_GROWTH[1] * first["rss"]):
            problems.append(f"{first['label']} (pid {pid}) RSS grew {growth / MIB:.1f} MiB")
        if last["fds"] - first["fds"] > FD_GROWTH:
            problems.append(f"{first['label']} (pid {pid}) open files {first['fds']} -> {last['fds']}")
    transient = sorted(
        {
            p["label"]
            for s in after
            for pid, p in s["procs"].items()
            if pid not in start["procs"] or pid not in end["procs"]
        }
    )
    tree = [(s["rollout"], sum(p["rss"] for p in s["procs"].values())) for s in after]
    tree_growth = tree[-1][1] - tree[0][1]
    if tree_growth > max(TREE_GROWTH[0], TREE_GROWTH[1] * tree[0][1]):
        problems.append(f"the process tree's RSS grew {tree_growth / MIB:.1f} MiB")
    half = [pt for pt in tree if pt[0] >= (tree[0][0] + tree[-1][0]) / 2]
    late_slope = slope(half) * 100
    if late_slope > SLOPE_PER_100:
        problems.append(f"the tree's RSS still climbs {late_slope / MIB:.1f} MiB per 100 rollouts over the last half")
    return {"start": {"t": start["t"], "rollout": start["rollout"]}, "end": {"t": end["t"], "rollout": end["rollout"]},
            "tree_rss_start": tree[0][1], "tree_rss_end": tree[-1][1], "late_slope_per_100": late_slope,
            "fds_start": sum(p["fds"] for p in start["procs"].values()),
            "fds_end": sum(p["fds"] for p in end["procs"].values()),
            "processes": rows, "transient": transient, "problems": problems}  # fmt: skip


def report(result: dict, wall: float) -> None:
    s, e = result["start"], result["end"]
    print(
        f"\nsoak: baseline at rollout {s['rollout']} ({s['t']:.0f} s), end at rollout {e['rollout']} ({e['t']:.0f} s)"
    )
    print(f"{'process':<34}{'pid':>8}{'RSS start MiB':>15}{'RSS end MiB':>13}{'growth MiB':>12}{'fds':>10}")
    for row in sorted(result["processes"], key=lambda r: -r["rss_end"]):
        growth = (row["rss_end"] - row["rss_start"]) / MIB
        fds = f"{row['fds_start']}->{row['fds_end']}"
        print(f"{row['label'][:33]:<34}{row['pid']:>8}{row['rss_start'] / MIB:>15.1f}{row['rss_end'] / MIB:>13.1f}"
              f"{growth:>12.1f}{fds:>10}")  # fmt: skip
    ts, te = result["tree_rss_start"] / MIB, result["tree_rss_end"] / MIB
    print(f"{'whole tree':<42}{ts:>15.1f}{te:>13.1f}{te - ts:>12.1f}{result['fds_start']:>5}->{result['fds_end']}")
    print(f"tree RSS slope over the last half: {result['late_slope_per_100'] / MIB:+.2f} MiB per 100 rollouts")
    if result["transient"]:
        print("not compared (started or ended between the two points): " + ", ".join(result["transient"]))
    print(f"wall {wall:.0f} s")
    print("within the bound" if not result["problems"] else "OVER THE BOUND: " + "; ".join(result["problems"]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", type=int, default=300)
    parser.add_argument("--save-interval", type=int, default=25)
    parser.add_argument("--eval-interval", type=int, default=25)
    parser.add_argument(
        "--warmup", type=int, default=None, help="Baseline after this many rollouts (default 10%%, ≥ 5)."
    )
    parser.add_argument("--loss-type", default="nft")
    parser.add_argument("--dp-size", type=int, default=2)
    parser.add_argument("--sample-s", type=float, default=2.0, help="Seconds between samples.")
    parser.add_argument("--out", default=None, help="Write the curve and the analysis here (JSON).")
    parser.add_argument("--keep", action="store_true", help="Keep the run's folder (printed) instead of deleting it.")
    parser.add_argument("extra", nargs="*", help="More train_diffusion.py flags (after --).")
    parser.add_argument("--analyse", default=None, help="Only analyse the curve an earlier --out wrote.")
    opts = parser.parse_args()
    if opts.analyse:
        with open(opts.analyse) as f:
            saved = json.load(f)
        samples = [{**s, "procs": {int(pid): p for pid, p in s["procs"].items()}} for s in saved["samples"]]
        result = analyse(samples, opts.warmup if opts.warmup is not None else max(5, saved["rollouts"] // 10))
        report(result, saved["wall_s"])
        return 1 if result["problems"] else 0
    warmup = opts.warmup if opts.warmup is not None else max(5, opts.rollouts // 10)
    workdir = tempfile.mkdtemp(prefix="miles_soak_")
    log_path = os.path.join(workdir, "driver.log")
    cmd = [sys.executable, os.path.join(ROOT, "train_diffusion.py"), *run_flags(opts, workdir)]
    print(f"bench_soak: {opts.rollouts} rollouts, baseline after {warmup}; driver log {log_path}", flush=True)
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        child = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    driver, samples, stop = psutil.Process(child.pid), [], threading.Event()
    metrics_path = os.path.join(workdir, "run", "metrics.jsonl")

    def sampler() -> None:
        shown = -1
        while not stop.is_set():
            try:
                samples.append(sample(driver, metrics_path, t0))
            except psutil.NoSuchProcess:
                return
            last = samples[-1]
            if last["rollout"] // 25 > shown // 25:
                shown = last["rollout"]
                tree = sum(p["rss"] for p in last["procs"].values()) / MIB
                print(f"  rollout {shown:>4}  {last['t']:>6.0f} s  {len(last['procs'])} processes  "
                      f"tree RSS {tree:.0f} MiB", flush=True)  # fmt: skip
            stop.wait(opts.sample_s)

    thread = threading.Thread(target=sampler, daemon=True)
    thread.start()
    rc = child.wait()
    stop.set()
    thread.join()
    wall = time.monotonic() - t0
    if rc != 0:
        with open(log_path) as f:
            tail = f.read()[-3000:]
        print(f"bench_soak: the run exited with {rc}; its log ends:\n{tail}", file=sys.stderr)
        return 2
    result = analyse(samples, warmup)
    report(result, wall)
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump({"flags": cmd[2:], "rollouts": opts.rollouts, "wall_s": wall, "analysis": result,
                       "samples": samples}, f)  # fmt: skip
        print(f"curve -> {opts.out}")
    if opts.keep:
        print(f"run folder kept: {workdir}")
    else:
        subprocess.run(["rm", "-rf", workdir], check=False)
    return 1 if result["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
