"""A picture of a run: the curves that matter for its loss type, from metrics.jsonl, as OUTPUT_DIR/metrics.png.

`python -m miles.plot OUTPUT_DIR` draws it on demand; the driver draws it at the end of every run.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from miles.utils.tracking import read_metrics, scalar_points

logger = logging.getLogger(__name__)

PLOT_FILE = "metrics.png"
# the panels of each loss type: (title, keys drawn in it); a panel none of whose keys the run logged is left out
COMMON_TAIL = (
    ("grad norm", ("train/grad_norm",)),
    ("seconds per rollout", ("perf/rollout_s", "perf/reward_s", "perf/train_s", "perf/weight_sync_s", "perf/eval_s")),
)
EVAL = (
    ("held-out accuracy", ("eval/shapes_accuracy", "eval/shapes_shape_accuracy", "eval/shapes_count_accuracy")),
    ("held-out reward", ("eval/shapes_reward_mean",)),
)
PANELS: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "policy_loss": (
        ("rollout reward", ("rollout/reward_mean",)),
        *EVAL,
        ("KL / clip fraction", ("train/kl", "train/approx_kl", "train/clipfrac")),
        *COMMON_TAIL,
    ),
    "nft": (
        ("rollout reward", ("rollout/reward_mean",)),
        *EVAL,
        ("NFT loss", ("train/loss", "train/nft_positive_loss", "train/nft_negative_loss")),
        ("KL / old-policy deviation", ("train/kl", "train/nft_old_deviate")),
        *COMMON_TAIL,
    ),
    "dmd2": (
        *EVAL,
        ("generator DMD loss", ("train/dmd_loss",)),
        ("critic loss", ("critic/train/critic_loss",)),
        ("rollout reward", ("rollout/reward_mean",)),
        *COMMON_TAIL,
    ),
    "sft_loss": (("flow-matching loss", ("train/loss",)), ("learning rate", ("train/lr",)), *COMMON_TAIL),
    "custom_loss": (("rollout reward", ("rollout/reward_mean",)), *EVAL, ("loss", ("train/loss",)), *COMMON_TAIL),
}
AXIS_LABELS = {"rollout_id": "rollout", "eval/rollouts_trained": "rollouts trained", "actor/step": "optimizer step"}


def infer_loss_type(records: list[dict[str, Any]]) -> str:
    """The loss type whose own metrics the run logged (metrics.jsonl does not name it)."""
    keys = {key for record in records for key in record}
    if "train/dmd_loss" in keys or "train/critic_loss" in keys:
        return "dmd2"
    if "train/nft_policy_loss" in keys:
        return "nft"
    if "train/ratio_mean" in keys:
        return "policy_loss"
    if "rollout/reward_mean" not in keys and "train/loss" in keys:
        return "sft_loss"
    return "custom_loss"


def series(records: list[dict[str, Any]]) -> dict[str, tuple[str, list[int], list[float]]]:
    """tag -> (axis name, xs, values), on the axes the trackers use (`scalar_points`)."""
    out: dict[str, tuple[str, list[int], list[float]]] = {}
    for record in records:
        for tag, axis, x, value in scalar_points(record):
            entry = out.setdefault(tag, (axis, [], []))
            entry[1].append(x)
            entry[2].append(value)
    return out


def running_mean(values: list[float], window: int) -> list[float]:
    """Mean of each value and the window - 1 before it (fewer at the start)."""
    return [sum(values[max(0, i - window + 1) : i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(values))]


def plot_panels(records: list[dict[str, Any]], loss_type: str) -> list[tuple[str, tuple[str, ...]]]:
    """The panels of PANELS[loss_type] with at least one series in the run, each keeping only the logged keys."""
    logged = series(records)
    panels = []
    for title, keys in PANELS.get(loss_type, PANELS["custom_loss"]):  # a loss type an --algorithm-path registers
        present = tuple(k for k in keys if k in logged)
        if present:
            panels.append((title, present))
    return panels


def plot_run(output_dir: str, loss_type: str | None = None, filename: str = PLOT_FILE) -> str | None:
    """Draw OUTPUT_DIR/metrics.jsonl into OUTPUT_DIR/`filename`; returns the PNG's path, or None when the run logged
    none of the loss type's metrics (e.g. it stopped before its first rollout)."""
    import matplotlib

    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # its one-time font cache notice
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = os.path.join(output_dir, "metrics.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} does not exist: pass the --output-dir of a run")
    records = read_metrics(path)
    loss_type = loss_type or infer_loss_type(records)
    panels = plot_panels(records, loss_type)
    if not panels:
        logger.info("%s holds none of the metrics a %s run is plotted by: no plot", path, loss_type)
        return None
    logged = series(records)
    columns = min(3, len(panels))
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.0 * rows), squeeze=False)
    for ax, (title, keys) in zip(axes.flat, panels):
        for key in keys:
            axis, xs, values = logged[key]
            label = key.split("/", 1)[-1]
            if len(xs) < 30:
                ax.plot(xs, values, marker="o", markersize=3, label=label)
                continue
            (line,) = ax.plot(xs, values, alpha=0.35, linewidth=0.8)  # noisy per-rollout values, and their trend
            ax.plot(xs, running_mean(values, max(2, len(values) // 10)), color=line.get_color(), label=label)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(AXIS_LABELS.get(logged[keys[0]][0], logged[keys[0]][0]), fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(f"{loss_type}: {output_dir}", fontsize=10)
    fig.tight_layout()
    out = os.path.join(output_dir, filename)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m miles.plot", description=__doc__.splitlines()[0])
    parser.add_argument("output_dir", help="A run's --output-dir (holds metrics.jsonl).")
    parser.add_argument(
        "--loss-type", choices=tuple(PANELS), default=None, help="Panels of this loss type (default: from the metrics)."
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        path = plot_run(args.output_dir, args.loss_type)
    except FileNotFoundError as exc:
        logger.error("%s", exc)
        return 1
    if path is None:
        return 1
    logger.info("wrote %s", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
