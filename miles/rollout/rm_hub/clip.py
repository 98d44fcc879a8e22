"""CLIP-family rewards: `clip_score` (image-text cosine) and `pickscore` (PickScore's logit_scale * cosine).

Models load from local folders (`--clip-model-path`, `--pickscore-model-path`), once per process.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

import torch

from miles.rollout.rm_hub.jpeg import sample_pil_image
from miles.utils.types import Sample

logger = logging.getLogger(__name__)

# Images and prompts go through the model this many at a time (bounds activation memory).
CLIP_BATCH_SIZE = 32
CLIP_EMBEDDING_KEY = "clip_image_embedding"  # Sample.extra: the unit image embedding, float32 (projection dim,)
_LOADED: dict[tuple[str, str], tuple[Any, Any]] = {}


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_clip(path: str | None, flag: str) -> tuple[Any, Any]:
    """(CLIPModel in eval mode, CLIPProcessor) from a local folder holding both; cached per process."""
    if not path:
        raise ValueError(
            f"{flag} is required: a local folder with a CLIP model and its processor (nothing is downloaded)"
        )
    if not os.path.isdir(path):
        raise ValueError(f"{flag} {path!r} is not a folder")
    key = (os.path.realpath(path), _device())
    if key in _LOADED:
        return _LOADED[key]
    from transformers import CLIPModel, CLIPProcessor  # local: ~1 s per process, only CLIP rewards need it

    try:
        processor = CLIPProcessor.from_pretrained(path, local_files_only=True)
    except Exception as exc:
        raise ValueError(
            f"{flag} {path!r}: cannot load a CLIP processor ({type(exc).__name__}: {exc}); the folder needs the "
            "tokenizer and preprocessor files too (PickScore_v1 ships without them: copy them from the CLIP it was "
            "trained from, laion/CLIP-ViT-H-14-laion2B-s32B-b79K)"
        ) from exc
    try:
        model = CLIPModel.from_pretrained(path, local_files_only=True)
    except Exception as exc:
        raise ValueError(f"{flag} {path!r}: cannot load a CLIPModel ({type(exc).__name__}: {exc})") from exc
    model = model.eval().requires_grad_(False).to(key[1])
    logger.info("loaded CLIP reward model from %s on %s", path, key[1])
    _LOADED[key] = (model, processor)
    return model, processor


@torch.no_grad()
def clip_embeddings(model: Any, processor: Any, samples: list[Sample]) -> tuple[torch.Tensor, torch.Tensor]:
    """Unit-norm (image, prompt) embeddings of each sample, float32 on CPU, each (N, projection dim)."""
    device = next(model.parameters()).device
    images, texts = [], []
    for start in range(0, len(samples), CLIP_BATCH_SIZE):
        chunk = samples[start : start + CLIP_BATCH_SIZE]
        pixels = processor.image_processor(images=[sample_pil_image(s) for s in chunk], return_tensors="pt")
        text = processor.tokenizer([s.prompt for s in chunk], padding=True, truncation=True, return_tensors="pt").to(
            device
        )
        image_emb = model.get_image_features(pixel_values=pixels["pixel_values"].to(device)).pooler_output
        text_emb = model.get_text_features(input_ids=text["input_ids"], attention_mask=text["attention_mask"])
        text_emb = text_emb.pooler_output
        images.append((image_emb / image_emb.norm(dim=-1, keepdim=True)).float().cpu())
        texts.append((text_emb / text_emb.norm(dim=-1, keepdim=True)).float().cpu())
    if not images:
        return torch.zeros(0, 0), torch.zeros(0, 0)
    return torch.cat(images), torch.cat(texts)


def image_text_cosine(model: Any, processor: Any, samples: list[Sample]) -> torch.Tensor:
    """Cosine similarity of each sample's image embedding with its own prompt's embedding, shape (N,); each
    sample's unit image embedding is kept in `extra["clip_image_embedding"]` (the diversity monitor reads it)."""
    image_emb, text_emb = clip_embeddings(model, processor, samples)
    for sample, embedding in zip(samples, image_emb.numpy()):
        sample.extra[CLIP_EMBEDDING_KEY] = embedding
    return (image_emb * text_emb).sum(dim=-1) if len(samples) else torch.zeros(0)


async def clip_score(args: argparse.Namespace, samples: list[Sample]) -> list[float]:
    """cos(image embedding, prompt embedding) in [-1, 1], unscaled (CLIPScore's 100 * max(cos, 0) is a rescale)."""
    model, processor = load_clip(args.clip_model_path, "--clip-model-path")
    return image_text_cosine(model, processor, samples).tolist()


async def pickscore(args: argparse.Namespace, samples: list[Sample]) -> list[float]:
    """PickScore: exp(logit_scale) * cos(image, prompt), as in the PickScore reference code (~20-23 for real images)."""
    model, processor = load_clip(args.pickscore_model_path, "--pickscore-model-path")
    scale = model.logit_scale.exp().float().cpu()
    return (scale * image_text_cosine(model, processor, samples)).tolist()
