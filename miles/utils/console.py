"""What a run prints: third-party noise silenced (driver and Ray workers), the progress bar's numbers, the closing
summary line."""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from collections.abc import Iterable, Sequence
from typing import Any

# transformers >= 5 warns once per process that its CLIP / SigLIP image processors fall back to PIL without
# torchvision; diffusers' SD3 pipeline imports them, miles never uses them, so the warning only says "install a
# package you do not need" from every actor
UNACTIONABLE = {"transformers.utils.import_utils": ("requires torchvision (not installed)",)}
# Ray workers: no loading bars from diffusers / transformers / huggingface_hub in every actor
WORKER_ENV = {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


class _DropMessages(logging.Filter):
    def __init__(self, fragments: tuple[str, ...]) -> None:
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(fragment in message for fragment in self.fragments)


def quiet_third_party() -> None:
    """Drop the UNACTIONABLE warnings in this process: `import miles` does it, before any family imports diffusers'
    pipelines (the driver, every Ray worker, tools and tests alike)."""
    for name, fragments in UNACTIONABLE.items():
        target = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) for f in target.filters):
            target.addFilter(_DropMessages(fragments))


def ray_init_kwargs(*, local: bool) -> dict[str, Any]:
    """`ray.init` settings of a quiet run: no start-up banner, WORKER_ENV in every worker (the UNACTIONABLE filter
    comes with `import miles`, the first thing a worker running miles' actors imports of it).

    `local` (a cluster this process starts): WORKER_ENV goes into this process's environment, which Ray's
    processes and so its workers inherit; the job then has no runtime env. A runtime env would cost every worker a
    second Python start (`setup_worker.py`, then the worker) and leave Ray's prestarted workers unused. Only
    third-party defaults move in this process (tqdm bars without an explicit `disable`: miles' own bar has one).
    Otherwise (`--ray-address`, other nodes' workers): WORKER_ENV as the job's runtime env.
    """
    if local:
        for name, value in WORKER_ENV.items():
            os.environ.setdefault(name, value)
        return {"logging_level": logging.WARNING}
    return {"logging_level": logging.WARNING, "runtime_env": {"env_vars": WORKER_ENV}}


class TqdmHandler(logging.StreamHandler):
    """A stderr log handler that writes above the progress bar instead of through it."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:  # noqa: BLE001 - logging's own contract: report, never raise
            self.handleError(record)


def setup_logging(output_dir: str, level: str, notes: Sequence[str] = ()) -> None:
    """The driver's logging: above the progress bar on stderr and into `<output_dir>/train.log`; then `notes` (the
    defaults chosen for what the command line left out), one line each."""
    os.makedirs(output_dir, exist_ok=True)
    handlers = [TqdmHandler(sys.stderr), logging.FileHandler(os.path.join(output_dir, "train.log"))]
    logging.basicConfig(
        level=getattr(logging, level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        handlers=handlers,
        force=True,
    )
    for note in notes:
        logging.getLogger("miles.driver").info("%s", note)


def progress_bar(rollout_ids: Iterable[int], args: argparse.Namespace):
    from tqdm import tqdm

    return tqdm(rollout_ids, desc=args.loss_type, unit="rollout", disable=args.no_progress, dynamic_ncols=True)


def engine_progress_display(bar: Any, label: str):
    """`display(text)` for `RolloutManager.show_engine_progress`: the bar's label followed by the engines' progress
    while a generation is awaited ("policy_loss [generate 37/80 steps]"), the label alone once it is in."""

    def display(text: str) -> None:
        bar.set_description_str(f"{label} [{text}]" if text else label)

    return display


ACCURACY_KEYS = ("eval/shapes_accuracy", "eval/ocr_accuracy")  # the held-out accuracy of a shapes or an OCR eval


def _accuracy_key(record: dict[str, Any]) -> str | None:
    return next((key for key in ACCURACY_KEYS if key in record), None)


class ProgressLine:
    """The bar's postfix: the latest value of each progress key the loss type's declaration names, and the last
    eval accuracy.

    A number that has been exactly 0 at every rollout so far is left out: Flow-GRPO's loss, ratio KL and clip fraction
    are 0 by construction with one optimizer step per rollout, and a constant says nothing.
    """

    def __init__(self, progress_keys: Sequence[tuple[str, str, str]]) -> None:
        """`progress_keys`: the loss type's declaration's (label, record key, format spec) triples."""
        self.keys = tuple(progress_keys)
        self.latest: dict[str, float] = {}
        self.moved: set[str] = set()

    def update(self, records: list[dict[str, Any]]) -> dict[str, str]:
        """`records`: this rollout's train records and its rollout record; returns the postfix to show."""
        for record in records:
            for key, value in record.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.latest[key] = float(value)
                    if value != 0:
                        self.moved.add(key)
        postfix = {}
        accuracy = _accuracy_key(self.latest)
        if accuracy is not None:
            postfix["acc"] = f"{self.latest[accuracy]:.3f}"
        for label, key, spec in self.keys:
            if key in self.moved:
                postfix[label] = format(self.latest[key], spec)
        return postfix


def format_duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes} min {secs:02d} s" if minutes else f"{seconds:.1f} s"


def summary_line(
    args: argparse.Namespace, records: list[dict[str, Any]], wall_s: float, plot_path: str | None = None
) -> str:
    """One line closing a run: wall time, baseline -> last held-out eval, and where the outputs are."""
    parts = [f"done in {format_duration(wall_s)}"]
    accuracy = next((key for r in records if (key := _accuracy_key(r)) is not None), None)
    evals: list[dict[str, Any]] = []
    if accuracy is not None:
        evals = [r for r in records if isinstance(r.get(accuracy), float) and math.isfinite(r[accuracy])]
    if evals and accuracy is not None:
        series = f"{evals[0][accuracy]:.3f}" + (f" -> {evals[-1][accuracy]:.3f}" if len(evals) > 1 else "")
        parts.append(f"eval accuracy on {args.eval_num_prompts} held-out prompts: {series}")
    parts.append(f"outputs in {args.output_dir}/ (metrics.jsonl, train.log, images/)")
    if plot_path:
        parts.append(f"plot {plot_path}")
    if args.save:
        parts.append(f"checkpoints in {args.save}")
    if args.save_hf:
        parts.append(f"pipeline in {args.save_hf}")
    return "; ".join(parts)
