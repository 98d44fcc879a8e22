"""Proxy against gold over a run: the held-out eval's trained (proxy) reward, its gold reward and gold accuracy
against the rollouts trained, one column per run, a guard's rollbacks marked.

    python scripts/plot_overoptimisation.py RUN_DIR [RUN_DIR ...] --labels "unguarded|rollback" --out plot.png

Each RUN_DIR is a run's --output-dir whose evals logged `eval/proxy_reward` and `eval/gold_reward` (a run with
`--gold-rm-type`); `eval/shapes_accuracy` is drawn when logged. The reward-gradient docs' over-optimisation figure is
drawn by this script (docs/user-guide/reward-gradients.md names the runs).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

from miles.utils.tracking import read_metrics

PROXY, GOLD, ACCURACY, TRAINED = (
    "eval/proxy_reward",
    "eval/gold_reward",
    "eval/shapes_accuracy",
    "eval/rollouts_trained",
)
ROLLBACK_TO = "monitor/rollback_to"


def eval_series(records: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """Each eval key's (rollouts trained, value) in the order logged, and the rollbacks as (rollout, restored one)."""
    out: dict[str, list[tuple[int, float]]] = {PROXY: [], GOLD: [], ACCURACY: [], ROLLBACK_TO: []}
    for record in records:
        if TRAINED in record:
            for key in (PROXY, GOLD, ACCURACY):
                if key in record:
                    out[key].append((int(record[TRAINED]), float(record[key])))
        if ROLLBACK_TO in record and "rollout_id" in record:
            out[ROLLBACK_TO].append((int(record["rollout_id"]), float(record[ROLLBACK_TO])))
    return out


def run_series(folder: str) -> dict[str, list[tuple[int, float]]]:
    path = os.path.join(folder, "metrics.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} does not exist: pass the --output-dir of a run")
    series = eval_series(read_metrics(path))
    if not series[PROXY] or not series[GOLD]:
        raise ValueError(f"{path} logged no {PROXY} / {GOLD}: the run needs --gold-rm-type and --eval-interval")
    return series


def plot(folders: Sequence[str], labels: Sequence[str], out: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(folders), figsize=(5.2 * len(folders), 3.6), squeeze=False)
    for ax, folder, label in zip(axes[0], folders, labels):
        series = run_series(folder)
        for key, name, style in ((PROXY, "proxy reward", "o-"), (GOLD, "gold reward", "s-")):
            xs, ys = zip(*series[key])
            ax.plot(xs, ys, style, markersize=3, label=name)
        if series[ACCURACY]:  # on its own scale: a fall of the all-correct share moves the mean reward far less
            xs, ys = zip(*series[ACCURACY])
            twin = ax.twinx()
            twin.plot(xs, ys, "^--", color="tab:green", markersize=3, label="gold all-correct (right)")
            twin.tick_params(labelsize=8)
            ax.plot([], [], "^--", color="tab:green", label="gold all-correct (right)")
        for rollout, restored in series[ROLLBACK_TO]:  # rollout ids: the weights after rollout r are r + 1 trained
            ax.axvline(rollout + 1, color="grey", linestyle=":", linewidth=1)
            note = f"rolled back to {int(restored) + 1} trained"
            ax.annotate(note, (rollout + 1, 0.02), xycoords=("data", "axes fraction"), fontsize=7, rotation=90)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("rollouts trained", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="Runs' --output-dir folders.")
    parser.add_argument("--labels", default=None, help="Titles separated by '|', one per run (default: the folders).")
    parser.add_argument("--out", required=True, help="The PNG to write.")
    args = parser.parse_args(argv)
    labels = args.labels.split("|") if args.labels else args.runs
    if len(labels) != len(args.runs):
        parser.error(f"--labels names {len(labels)} runs, {len(args.runs)} given")
    print(plot(args.runs, labels, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
