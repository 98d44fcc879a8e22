"""Regenerate the measured numbers of the docs from clean runs, so they cannot go stale.

`python scripts/regen_results.py` runs the demo (`train_diffusion.py` with no flags) and the same run on seeds 1, 2
and 3, one after another, each into `outputs/results/<run>/`, then rewrites what sits between the `<!-- regen:NAME -->`
and `<!-- /regen:NAME -->` markers of README.md, docs/results.md and the quick start (the learning table, the
headline, the demo's summary line) and copies the demo's held-out grids and metrics.png to docs/images/. The table
holds every finished run in `--runs-dir`, each with its date and commit. `--runs demo` runs the demo only;
`--render-only` re-renders from the finished runs already there (none: only the support table). The README's support
table (families x algorithms x rewards) is rendered from the registries on every call; `--check` only says whether it
is current (exit 1 if not).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from miles.algorithms.registry import BUILTIN_ALGORITHMS  # noqa: E402  (the repository root goes on the path first)
from miles.arguments.reward_spec import (  # noqa: E402
    BUILTIN_REWARDS,
    CUSTOM,
    EITHER_MEDIA,
    SOURCE_IMAGE_REWARDS,
    VIDEO_REWARDS,
)
from miles.models.registry import BUILTIN_FAMILIES  # noqa: E402

README = os.path.join(ROOT, "README.md")
RESULTS = os.path.join(ROOT, "docs", "results.md")
QUICK_START = os.path.join(ROOT, "docs", "user-guide", "quick-start.md")
IMAGES = os.path.join(ROOT, "docs", "images")
ACCURACY = "eval/shapes_accuracy"
REWARD = "eval/shapes_reward_mean"
EVAL_AXIS = "eval/rollouts_trained"
# name -> flags added to `python train_diffusion.py` (the demo is the run with no flags at all)
RUNS: dict[str, list[str]] = {
    "demo": [],
    "seed1": ["--seed", "1", "--rollout-seed", "1"],
    "seed2": ["--seed", "2", "--rollout-seed", "2"],
    "seed3": ["--seed", "3", "--rollout-seed", "3"],
}
# what each built-in loss type is, for the support table (a test fails when the registry has one without a line)
ALGORITHM_NAMES: dict[str, str] = {
    "sft_loss": "supervised flow matching",
    "grpo_guard": "GRPO-Guard",
    "flow_dppo": "Flow-DPPO",
    "policy_loss": "Flow-GRPO (DanceGRPO and MixGRPO as its options)",
    "nft": "DiffusionNFT (the default)",
    "dmd2": "DMD2 distillation",
    "dpo": "Diffusion-DPO, online or offline",
    "awm": "advantage-weighted matching",
    "refl": "ReFL",
    "draft": "DRaFT-K and DRaFT-LV",
    "direct_align": "Direct-Align (SRPO)",
    "custom_loss": "your hooks",
}


def replace_between(text: str, name: str, body: str) -> str:
    """`text` with what lies between its `<!-- regen:name -->` and `<!-- /regen:name -->` markers set to `body`."""
    pattern = re.compile(rf"(<!-- regen:{re.escape(name)} -->\n).*?(<!-- /regen:{re.escape(name)} -->)", re.DOTALL)
    if not pattern.search(text):
        raise ValueError(f"no '<!-- regen:{name} -->' ... '<!-- /regen:{name} -->' markers (each on its own line)")
    return pattern.sub(lambda m: m.group(1) + body.rstrip("\n") + "\n" + m.group(2), text, count=1)


def _families_by_kind() -> list[tuple[str, list[str]]]:
    kinds: dict[str, list[str]] = {"text to image": [], "editing (source images)": [], "video": []}
    for name, entry in BUILTIN_FAMILIES.items():
        kind = "video" if entry.video else "editing (source images)" if entry.source_images else "text to image"
        kinds[kind].append(f"`{name}` ({entry.pipeline_class_name})")
    return [(kind, names) for kind, names in kinds.items() if names]


def _rewards_for(kind: str) -> list[str]:
    video = kind == "video"
    names = [r for r in BUILTIN_REWARDS if r in EITHER_MEDIA or (r in VIDEO_REWARDS) == video]
    if kind != "editing (source images)":
        names = [r for r in names if r not in SOURCE_IMAGE_REWARDS]
    return [f"`{r}`" for r in names] + [f"`{CUSTOM}` (`--custom-rm-path`)", "a reward server (`--rm-url`)"]


def support_table() -> str:
    """The README's table of families x algorithms x rewards, from the three registries."""
    builtin = [a.name for a in BUILTIN_ALGORITHMS]  # not a plugin a process registered
    missing = sorted(set(builtin) - set(ALGORITHM_NAMES))
    if missing:
        raise ValueError(f"scripts/regen_results.py: ALGORITHM_NAMES has no line for {', '.join(missing)}")
    lines = ["| | model families (`--model-family`) | rewards (`--rm-type`) |", "|---|---|---|"]
    for kind, families in _families_by_kind():
        lines.append(f"| **{kind}** | {', '.join(families)} | {', '.join(_rewards_for(kind))} |")
    lines.append("")
    loss_types = "; ".join(f"`{name}` {ALGORITHM_NAMES[name]}" for name in builtin)
    lines.append(f"Loss types (`--loss-type`), each for every family but where the notes below say: {loss_types}.")
    return "\n".join(lines) + "\n"


def _git_commit() -> str:
    out = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    # only the code a run executes counts: the docs this script rewrites are expected to differ
    code = ["miles", "train_diffusion.py", "configs"]
    dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--", *code], capture_output=True)
    return out.stdout.strip() + (" (with uncommitted changes to the code)" if dirty.stdout.strip() else "")


def run_one(name: str, runs_dir: str) -> dict[str, Any]:
    """Run `python train_diffusion.py` with RUNS[name]'s flags into runs_dir/name; write and return its regen.json."""
    out_dir = os.path.join(runs_dir, name)
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)  # a clean run: nothing of an earlier one may be read back
    os.makedirs(out_dir)
    command = [sys.executable, "train_diffusion.py", *RUNS[name], "--output-dir", out_dir, "--no-progress"]
    record = {
        "run": name,
        "flags": " ".join(RUNS[name]) or "(none: the demo)",
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "commit": _git_commit(),
        "machine": f"{os.cpu_count()} CPU cores, {platform.machine()}, load average {os.getloadavg()[0]:.1f} at start",
    }
    print(f"[regen] {name}: {' '.join(command[1:])}", flush=True)
    start = time.monotonic()
    with open(os.path.join(out_dir, "console.txt"), "w") as console:
        proc = subprocess.run(command, cwd=ROOT, stdout=console, stderr=subprocess.STDOUT)
    record["wall_s"] = round(time.monotonic() - start, 1)
    record["returncode"] = proc.returncode
    with open(os.path.join(out_dir, "regen.json"), "w") as f:
        json.dump(record, f, indent=1)
    if proc.returncode != 0:
        raise SystemExit(f"[regen] {name} failed (exit {proc.returncode}): see {out_dir}/console.txt")
    return record


def summarize(run_dir: str) -> dict[str, Any]:
    """A finished run's regen.json record with its held-out evals: {rollouts trained: (accuracy, reward)}."""
    with open(os.path.join(run_dir, "regen.json")) as f:
        record = json.load(f)
    evals: dict[int, tuple[float, float]] = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            if ACCURACY in row:
                evals[int(row.get(EVAL_AXIS, row.get("rollout_id", 0)))] = (row[ACCURACY], row[REWARD])
    if len(evals) < 2:
        raise ValueError(f"{run_dir}/metrics.jsonl holds {len(evals)} held-out eval(s); a finished run has two or more")
    record["evals"] = dict(sorted(evals.items()))
    record["summary_line"] = _summary_line(os.path.join(run_dir, "console.txt"))
    return record


def _summary_line(console_path: str) -> str:
    with open(console_path) as f:
        lines = [line for line in f if "done in " in line and "eval accuracy" in line]
    if not lines:
        raise ValueError(f"{console_path}: no summary line ('done in ...'): the run did not finish")
    # the log prefix off; paths relative to the repository, as a run started from its root prints them
    return lines[-1].split(" INFO ")[-1].split(": ", 1)[-1].strip().replace(ROOT + os.sep, "")


def _series(run: dict[str, Any]) -> str:
    return " -> ".join(f"{accuracy:.3f}" for accuracy, _ in run["evals"].values())


def learning_table(runs: list[dict[str, Any]]) -> str:
    """The results page's table: accuracy after each eval, the gain, the eval reward, the wall time, per run."""
    rollouts = list(runs[0]["evals"])
    head = " | ".join(f"after {r}" if r else "before (0)" for r in rollouts)
    lines = [f"| run (flags) | {head} | gain | eval reward | wall time | measured (UTC, commit) |"]
    lines.append("|---" * (len(rollouts) + 5) + "|")
    for run in runs:
        values = list(run["evals"].values())
        cells = " | ".join(f"{accuracy:.3f}" for accuracy, _ in values)
        gain = f"{100 * (values[-1][0] - values[0][0]):+.1f} pts"
        reward = f"{values[0][1]:.3f} -> {values[-1][1]:.3f}"
        measured = f"{run['date_utc']}, {run['commit']}"
        lines.append(
            f"| {run['run']} (`{run['flags']}`) | {cells} | {gain} | {reward} | {run['wall_s']:.0f} s | {measured} |"
        )
    lines.append("")
    machines = "; ".join(f"{run['run']}: {run['machine']}" for run in runs)
    lines.append(f"Measured by `python scripts/regen_results.py`, one run at a time ({machines}).")
    return "\n".join(lines) + "\n"


def headline(demo: dict[str, Any]) -> str:
    """The README's one-line result of the demo."""
    values = list(demo["evals"].values())
    return (
        f"Held-out accuracy (`eval/shapes_accuracy`, 500 prompts, every attribute right) "
        f"**{_series(demo)}** over {list(demo['evals'])[-1]} rollouts, eval reward {values[0][1]:.3f} -> "
        f"{values[-1][1]:.3f} (measured {demo['date_utc'][:10]}, commit {demo['commit']}, "
        f"[results](docs/results.md)).\n"
    )


def copy_images(run_dir: str, rollouts: list[int]) -> None:
    """The demo's first and last held-out grids and its metrics.png, into docs/images/."""
    copies = {
        f"images/eval_{rollouts[0]:07d}.png": "demo_eval_before.png",
        f"images/eval_{rollouts[-1]:07d}.png": "demo_eval_after.png",
        "metrics.png": "demo_metrics.png",
    }
    for source, target in copies.items():
        shutil.copyfile(os.path.join(run_dir, source), os.path.join(IMAGES, target))


def _rewrite(path: str, sections: dict[str, str]) -> bool:
    with open(path) as f:
        text = f.read()
    new = text
    for name, body in sections.items():
        new = replace_between(new, name, body)
    if new != text:
        with open(path, "w") as f:
            f.write(new)
    return new != text


def _finished(run_dir: str) -> bool:
    """The run ended with exit code 0 (a failed run's regen.json says its code; one under way has none yet)."""
    path = os.path.join(run_dir, "regen.json")
    if not os.path.exists(path):
        return False
    with open(path) as f:
        return json.load(f)["returncode"] == 0


def render(runs_dir: str) -> None:
    """Rewrite the README's support table, and the regenerated sections of the README, the results page and the
    quick start from every finished run in runs_dir (exit code 0; those sections stay as they are without one)."""
    finished = [name for name in RUNS if _finished(os.path.join(runs_dir, name))]
    runs = [summarize(os.path.join(runs_dir, name)) for name in finished]
    readme: dict[str, str] = {"support": support_table()}
    results: dict[str, str] = {"learning": learning_table(runs)} if runs else {}
    quick_start: dict[str, str] = {}
    demo = next((run for run in runs if run["run"] == "demo"), None)
    if demo is not None:
        copy_images(os.path.join(runs_dir, "demo"), list(demo["evals"]))
        readme["headline"] = headline(demo)
        readme["demo-output"] = quick_start["demo-output"] = f"```text\n{demo['summary_line']}\n```\n"
    print(f"[regen] finished runs in {runs_dir}: {', '.join(finished) or 'none'}")
    for path, sections in ((README, readme), (RESULTS, results), (QUICK_START, quick_start)):
        print(f"[regen] {os.path.relpath(path, ROOT)}: {'rewritten' if _rewrite(path, sections) else 'unchanged'}")


def support_table_is_current() -> bool:
    with open(README) as f:
        text = f.read()
    return replace_between(text, "support", support_table()) == text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS), help="which runs (default: all)")
    parser.add_argument("--runs-dir", default=os.path.join(ROOT, "outputs", "results"))
    parser.add_argument("--render-only", action="store_true", help="re-render from the runs already in --runs-dir")
    parser.add_argument("--check", action="store_true", help="exit 1 if the README's support table is not current")
    args = parser.parse_args(argv)
    if args.check:
        current = support_table_is_current()
        print("[regen] support table " + ("current" if current else "stale: run python scripts/regen_results.py"))
        return 0 if current else 1
    if not args.render_only:
        for name in args.runs:
            run_one(name, args.runs_dir)
    render(args.runs_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
