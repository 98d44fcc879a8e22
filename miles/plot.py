"""A picture of a run: the panels its algorithm declares, from metrics.jsonl, as OUTPUT_DIR/metrics.png.

`python -m miles.plot OUTPUT_DIR` draws it on demand; the driver draws it at the end of every run.
"""

from __future__ import annotations

import argparse
import fnmatch
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from miles.algorithms import ALGORITHMS, get_algorithm
from miles.algorithms.base import DEFAULT_PLOT_PANELS, PlotPanel
from miles.utils.misc import HookLoadError, load_module
from miles.utils.tracking import current_records, read_metrics, scalar_points

logger = logging.getLogger(__name__)

PLOT_FILE = "metrics.png"
AXIS_LABELS = {"rollout_id": "rollout", "eval/rollouts_trained": "rollouts trained", "actor/step": "optimizer step"}


def infer_loss_type(records: list[dict[str, Any]]) -> str | None:
    """The registered algorithm whose own metrics (`identifying_metrics`) the run logged (metrics.jsonl does not name
    it); a run that logged no rollout reward without such metrics trained on a dataset, without engines. None: no
    declaration recognises the run (it is drawn with the default panels)."""
    keys = {key for record in records for key in record}
    for algorithm in ALGORITHMS.values():
        if keys & set(algorithm.identifying_metrics):
            return algorithm.name
    if "rollout/reward_mean" not in keys and "train/loss" in keys:
        return next((a.name for a in ALGORITHMS.values() if not a.uses_engines), None)
    return None


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


def logged_keys(keys: Sequence[str], logged: dict[str, Any]) -> tuple[str, ...]:
    """The keys that were logged, in order; a key with `*` stands for every logged key it matches, sorted."""
    out: list[str] = []
    for key in keys:
        if "*" in key:
            matches = sorted(tag for tag in logged if fnmatch.fnmatchcase(tag, key))
        else:
            matches = [key] if key in logged else []
        out += [m for m in matches if m not in out]
    return tuple(out)


def plot_panels(records: list[dict[str, Any]], loss_type: str | None) -> list[PlotPanel]:
    """The panels the loss type declares (None: the default ones) with at least one series in the run, each keeping
    only the logged keys; a panel whose series an earlier panel already draws is left out (the monitors' KL panel
    under an algorithm that plots its KL)."""
    logged = series(records)
    panels: list[PlotPanel] = []
    drawn: set[str] = set()
    for title, keys in get_algorithm(loss_type).plot_panels if loss_type else DEFAULT_PLOT_PANELS:
        present = logged_keys(keys, logged)
        if present and not set(present) <= drawn:
            panels.append((title, present))
            drawn.update(present)
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
    records = current_records(read_metrics(path))  # without the rollouts a restart redid
    loss_type = loss_type or infer_loss_type(records)
    panels = plot_panels(records, loss_type)
    if not panels:
        logger.info("%s holds none of the metrics a %s run is plotted by: no plot", path, loss_type or "miles")
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
    fig.suptitle(f"{loss_type or 'run'}: {output_dir}", fontsize=10)
    fig.tight_layout()
    out = os.path.join(output_dir, filename)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--algorithm-path", default=None)
    plugin = first.parse_known_args(argv)[0].algorithm_path
    parser = argparse.ArgumentParser(prog="python -m miles.plot", description=__doc__.splitlines()[0])
    parser.add_argument("output_dir", help="A run's --output-dir (holds metrics.jsonl).")
    parser.add_argument("--algorithm-path", default=None, help="The run's plugin module (declaring its panels).")
    try:
        if plugin:
            load_module(plugin)  # first: its algorithms are --loss-type choices
    except HookLoadError as exc:
        parser.error(f"--algorithm-path: {exc}")
    parser.add_argument(
        "--loss-type",
        choices=tuple(ALGORITHMS),
        default=None,
        help="Panels of this loss type (default: from the metrics).",
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
