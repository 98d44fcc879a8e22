"""Dataset pairs, shared by every algorithm that trains on (prompt, image) records (sft_loss; custom_loss and dpo
under --train-only): records encoded once with the family's VAE and text encoders into train pairs of clean latents
and their conditioning (the rollout side owns every encoder; the trainer gets pairs only)."""

from __future__ import annotations

import argparse
import logging
from typing import Any

import numpy as np
import torch
from PIL import Image

from miles.data.source_images import load_source_images
from miles.models.conditioning import Conditioning
from miles.rollout.data_source import load_records
from miles.rollout.rollout_hub.spec import DatasetSpec
from miles.utils.types import TrainPairs

logger = logging.getLogger(__name__)
ENCODE_BATCH = 64  # records per encoder call


def image_to_tensor(image: Any, resolution: int) -> torch.Tensor:
    """A PIL image or a path -> (3, H, W) float tensor in [-1, 1] at `resolution`; a clip's frames (F, H, W, 3)
    uint8 (a video world's target, e.g. builtin:moving-shapes) -> (F, 3, H, W), each frame at `resolution`."""
    if isinstance(image, np.ndarray) and image.ndim == 4:
        return torch.stack([image_to_tensor(Image.fromarray(frame), resolution) for frame in image])
    if isinstance(image, str):
        try:
            image = Image.open(image)
        except OSError as exc:
            raise ValueError(f"cannot read image {image}: {exc}") from exc
    image = image.convert("RGB")
    if image.size != (resolution, resolution):
        image = image.resize((resolution, resolution), Image.Resampling.BICUBIC)
    array = np.asarray(image, dtype=np.float32) / 127.5 - 1.0
    return torch.from_numpy(array).permute(2, 0, 1).contiguous()


@torch.no_grad()
def encode_records(family: Any, records: list[dict], resolution: int, batch_size: int = ENCODE_BATCH) -> TrainPairs:
    """Every record through the family's VAE (its image) and text encoders (its prompt), `batch_size` at a time."""
    latents: list[torch.Tensor] = []
    embeds: list[Conditioning] = []
    for start in range(0, len(records), batch_size):
        chunk = records[start : start + batch_size]
        images = torch.stack([image_to_tensor(r["image"], resolution) for r in chunk])
        sources = None  # an editing family's (source, instruction, target) triples: conditioned on the source
        if any(r.get("source_images") is not None for r in chunk):
            sources = [load_source_images(r.get("source_images"), resolution) or [] for r in chunk]
        cond, _ = family.encode_request([r["prompt"] for r in chunk], sources, "", negative=False)
        embeds.append(cond.to(device="cpu", dtype=torch.float32))
        latents.append(family.encode_images(images).float().cpu())
    # Conditioning.cat: chunks of a family with variable-length prompts are padded to one length
    return {"x0": torch.cat(latents), **Conditioning.cat(embeds).to_columns()}


def encode_dataset(args: argparse.Namespace, family: Any, records: list[dict], *, resolution: int) -> TrainPairs:
    """The DatasetSpec entry: load the VAE and the text encoders, then encode every record once."""
    family.load_vae()
    family.load_text_encoders()
    return encode_records(family, records, resolution)


def dataset_records(args: argparse.Namespace, spec: DatasetSpec, *, resolution: int) -> list[dict[str, Any]]:
    """A dataset-fed run's records: its entry's own (a file its flag names), else --prompt-data's with their
    images (the run's start-up encodes them all; the planner the first few)."""
    if spec.records is not None:
        return spec.records(args, resolution=resolution)
    return load_records(args, with_images=True, resolution=resolution)


DATASET_SPEC = DatasetSpec(encode=encode_dataset)
