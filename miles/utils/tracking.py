"""Metrics sinks: `metrics.jsonl` always (the source of truth); TensorBoard and wandb when asked (§10).

Every record the driver logs goes to the JSONL file as it is; `Tracking` also forwards its numbers, and the image
grids written under OUTPUT_DIR/images/, to the trackers, each on the axis it belongs to (`scalar_points`).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import socket
from typing import Any
from urllib.parse import urlparse

logger = logging.getLogger(__name__)

NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
# the x of an eval is the number of rollouts the evaluated weights were trained on (0: the baseline)
EVAL_AXIS = "eval/rollouts_trained"
IMAGE_FILE = re.compile(r"^(rollout|eval)_(\d+)\.png$")


class MetricsWriter:
    """One JSON object per line; NaN and ±inf as the strings "nan", "inf", "-inf". Each record reaches the file in
    one `os.write` of the whole line (no buffer that a kill could leave half-flushed), and a resumed run first drops
    a last line the run before left cut mid-record (`drop_partial_line`)."""

    def __init__(self, output_dir: str, filename: str = "metrics.jsonl") -> None:
        os.makedirs(output_dir, exist_ok=True)
        self.path = os.path.join(output_dir, filename)
        drop_partial_line(self.path)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def log(self, record: dict[str, Any]) -> None:
        line = (json.dumps({k: _encode(v) for k, v in record.items()}, sort_keys=True) + "\n").encode()
        view = memoryview(line)
        assert self._fd is not None, f"{self.path} was closed"
        while view:  # a regular file takes the whole line at once; a short write (a signal) is continued
            view = view[os.write(self._fd, view) :]

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def drop_partial_line(path: str) -> None:
    """A metrics file whose last line has no newline was cut while being written (its run was killed): that line is
    dropped with a warning naming the file and the line, the records before it kept; a last line that is whole JSON
    only lacking its newline gets it."""
    if not os.path.isfile(path):
        return
    with open(path, "rb") as f:
        data = f.read()
    if not data or data.endswith(b"\n"):
        return
    start = data.rfind(b"\n") + 1
    tail = data[start:]
    try:
        json.loads(tail)
    except ValueError:
        line = data.count(b"\n") + 1
        logger.warning(
            "%s:%d: the last line was cut mid-record (%d bytes; the run that wrote it was stopped while writing): "
            "dropped it, keeping the %d records before it",
            path,
            line,
            len(tail),
            line - 1,
        )
        os.truncate(path, start)
        return
    with open(path, "ab") as f:
        f.write(b"\n")


def _encode(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl, with "nan" / "inf" / "-inf" read back as floats. A line that is not a JSON
    object (a record cut by a killed run, read before a resumed run dropped it) is skipped with a warning naming the
    file and the line."""
    records = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except ValueError:
                record = None
            if not isinstance(record, dict):
                logger.warning("%s:%d: not a whole JSON record (cut while written?); skipped", path, number)
                continue
            records.append({k: NON_FINITE.get(v, v) if isinstance(v, str) else v for k, v in record.items()})
    return records


RESTART_KEY = "restart/count"  # a restart's record (miles/ray/restarts.py): rollouts from its rollout_id on redone


def current_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of the rollouts that count: a restart's record (`--max-restarts`) drops the records logged before
    it for the rollouts it redoes (those from its rollout_id on); the restart records themselves stay."""
    kept: list[dict[str, Any]] = []
    for record in records:
        if RESTART_KEY in record:
            kept = [r for r in kept if RESTART_KEY in r or r.get("rollout_id", -1) < record["rollout_id"]]
        kept.append(record)
    return kept


def scalar_points(record: dict[str, Any]) -> list[tuple[str, str, int, float]]:
    """(tag, axis name, x, value) of each number in a record.

    Train records (they carry a "role") go on that role's optimizer step; a critic's tags get a "critic/" prefix so
    they do not mix with the actor's. `eval/*` and `perf/eval_s` go on EVAL_AXIS, everything else on the rollout id.
    """
    role = record.get("role")
    points = []
    for key, value in sorted(record.items()):
        if key in ("rollout_id", "step", "role") or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if role is not None:
            tag = key if role == "actor" else f"{role}/{key}"
            points.append((tag, f"{role}/step", int(record["step"]), float(value)))
        elif key.startswith("eval/") or key == "perf/eval_s":
            points.append((key, EVAL_AXIS, int(record.get(EVAL_AXIS, record["rollout_id"])), float(value)))
        else:
            points.append((key, "rollout_id", int(record["rollout_id"]), float(value)))
    return points


class TensorBoardSink:
    """Event files under OUTPUT_DIR/tensorboard (`tensorboard --logdir` reads them)."""

    def __init__(self, logdir: str) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ImportError(f"--use-tensorboard needs TensorBoard: pip install 'miles[tensorboard]' ({exc})") from exc
        self.logdir = logdir
        self._writer = SummaryWriter(log_dir=logdir)

    def add_scalars(self, points: list[tuple[str, str, int, float]]) -> None:
        for tag, _, x, value in points:
            self._writer.add_scalar(tag, value, global_step=x)

    def add_image(self, tag: str, axis: str, x: int, path: str) -> None:
        import numpy as np
        from PIL import Image

        self._writer.add_image(tag, np.asarray(Image.open(path).convert("RGB")), global_step=x, dataformats="HWC")

    def close(self) -> None:
        self._writer.close()


def wandb_mode() -> str:
    """WANDB_MODE when set; else online if the wandb server answers within 3 s, offline otherwise."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    url = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai"))
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout=3).close()
    except OSError:
        return "offline"
    return "online"


class WandbSink:
    """A wandb run in OUTPUT_DIR/wandb: `--wandb-project`, `--wandb-group`, `--wandb-run-name`, the flags as config."""

    def __init__(self, args: argparse.Namespace) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise ImportError(f"--use-wandb needs wandb: pip install 'miles[wandb]' ({exc})") from exc
        self._wandb = wandb
        mode = wandb_mode()
        config = {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, type(None)))}
        self.run = wandb.init(
            project=args.wandb_project,
            group=args.wandb_group,
            name=args.wandb_run_name,
            dir=args.output_dir,
            mode=mode,  # type: ignore[arg-type]  # WANDB_MODE passes through as given; wandb.init checks it
            config=config,
        )
        if mode == "offline":
            logger.info("wandb logs offline to %s (upload it with `wandb sync %s`)", self.run.dir, self.run.dir)
        self._defined: set[str] = set()

    def _define(self, tag: str, axis: str) -> None:
        """Plot `tag` against `axis` (a value logged beside it): wandb's own step must only grow, and the
        optimizer-step, rollout and eval axes here interleave."""
        if axis not in self._defined:
            self.run.define_metric(axis)
            self._defined.add(axis)
        if tag not in self._defined:
            self.run.define_metric(tag, step_metric=axis)
            self._defined.add(tag)

    def add_scalars(self, points: list[tuple[str, str, int, float]]) -> None:
        if not points:
            return
        data: dict[str, Any] = {}
        for tag, axis, x, value in points:
            self._define(tag, axis)
            data[axis], data[tag] = x, value
        self.run.log(data)

    def add_image(self, tag: str, axis: str, x: int, path: str) -> None:
        self._define(tag, axis)
        self.run.log({axis: x, tag: self._wandb.Image(path)})

    def close(self) -> None:
        self.run.finish()
        self._wandb.teardown()  # finish() returns before wandb's writer process has flushed the run's files


class Tracking:
    """metrics.jsonl plus the trackers of `--use-tensorboard` / `--use-wandb`; drop-in for MetricsWriter."""

    def __init__(self, output_dir: str, sinks: list | None = None) -> None:
        self.jsonl = MetricsWriter(output_dir)
        self.path = self.jsonl.path
        self.images_dir = os.path.join(output_dir, "images")
        self.sinks = sinks or []
        self._images_seen = set(self._image_files()) if self.sinks else set()  # a resumed run's older grids

    def log(self, record: dict[str, Any]) -> None:
        self.jsonl.log(record)
        if not self.sinks:
            return
        points = scalar_points(record)
        for sink in self.sinks:
            sink.add_scalars(points)
        if "role" not in record:  # rollout and eval records come after their grids are written
            self.log_new_images()

    def _image_files(self) -> list[str]:
        return sorted(os.listdir(self.images_dir)) if os.path.isdir(self.images_dir) else []

    def log_new_images(self) -> None:
        """Send the grids that appeared under images/ since the last call: `rollout/images` on the rollout id,
        `eval/images` on EVAL_AXIS (the file's number is the rollouts trained)."""
        for name in self._image_files():
            match = IMAGE_FILE.match(name)
            if name in self._images_seen or match is None:
                continue
            self._images_seen.add(name)
            kind, number = match.group(1), int(match.group(2))
            for sink in self.sinks:
                sink.add_image(
                    f"{kind}/images",
                    "rollout_id" if kind == "rollout" else EVAL_AXIS,
                    number,
                    os.path.join(self.images_dir, name),
                )

    def close(self) -> None:
        self.jsonl.close()
        if self.sinks:
            self.log_new_images()
        for sink in self.sinks:
            sink.close()


def open_tracking(args: argparse.Namespace) -> Tracking:
    """The run's metrics sinks; fails at once, naming the extra to install, when a tracker's library is missing."""
    sinks: list = []
    if args.use_tensorboard:
        sinks.append(TensorBoardSink(os.path.join(args.output_dir, "tensorboard")))
    if args.use_wandb:
        sinks.append(WandbSink(args))
    return Tracking(args.output_dir, sinks)


def first_compile_seconds(rollout_record: dict[str, Any], train_records: list[dict[str, Any]]) -> float:
    """With --compile, the start-up's last part: torch compiles at the first calls (it needs the batch's shapes), so
    the first rollout's generate and train phases hold the compiling, the engines' (the most of any engine) and then
    the trainer's (rank 0's). Logged beside the start-up and recorded as `perf/startup_compile_s`."""
    engine = rollout_record.get("perf/engine_compile_s", 0.0)
    trainer = max((r["perf/compile_s"] for r in train_records if "perf/compile_s" in r), default=0.0)
    logging.getLogger("miles.driver").info(
        "start-up, continued: --compile compiled %.1fs in the first rollout (engines %.1fs, then the trainer %.1fs)",
        engine + trainer,
        engine,
        trainer,
    )
    return engine + trainer
