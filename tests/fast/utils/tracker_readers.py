"""Read what the trackers wrote, through their own formats: TensorBoard event files and an offline wandb run."""

from __future__ import annotations

import glob
import json
import os
import struct

import numpy as np


def read_tensorboard(logdir: str) -> tuple[dict[str, dict[int, float]], dict[str, dict[int, np.ndarray]]]:
    """(tag -> {step: value}, tag -> {step: image (H, W, 3) uint8}) from the event files under `logdir`."""
    import io

    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(logdir, size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    tags = events.Tags()
    scalars = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in tags["scalars"]}
    images = {
        tag: {
            e.step: np.asarray(Image.open(io.BytesIO(e.encoded_image_string)).convert("RGB"))
            for e in events.Images(tag)
        }
        for tag in tags["images"]
    }
    return scalars, images


def _wandb_records(path: str) -> list[bytes]:
    """The protobuf records of a .wandb file: a LevelDB-style log (7-byte header ":W&B" + magic + version, then
    32 KiB blocks of chunks, each with a 7-byte header: crc32c, length, type 1 full / 2 first / 3 middle / 4 last)."""
    data = open(path, "rb").read()
    assert data[:4] == b":W&B", f"{path} is not a wandb transaction log"
    block, pos, chunk, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pos += 7
        if kind == 0 and length == 0:
            break
        chunk += data[pos : pos + length]
        pos += length
        if kind in (1, 4):
            records.append(chunk)
            chunk = b""
    return records


def read_wandb_offline(wandb_dir: str) -> tuple[list[dict], str]:
    """(history rows, the run's files/ folder) of the one offline run under `wandb_dir`; an image's value in a row
    is its dict ({"_type": "image-file", "path": "media/images/...png", ...}, the path under files/)."""
    from wandb.proto import wandb_internal_pb2

    runs = glob.glob(os.path.join(wandb_dir, "offline-run-*"))
    assert len(runs) == 1, runs
    (log_file,) = glob.glob(os.path.join(runs[0], "run-*.wandb"))
    rows = []
    for raw in _wandb_records(log_file):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") != "history":
            continue
        row: dict = {}
        for item in record.history.item:
            *parents, leaf = list(item.nested_key) or [item.key]
            node = row
            for parent in parents:
                node = node.setdefault(parent, {})
            node[leaf] = json.loads(item.value_json)
        rows.append(row)
    return rows, os.path.join(runs[0], "files")
