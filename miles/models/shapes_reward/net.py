"""The learned shapes reward networks (`--rm-type shapes_learned`, `shapes_learned_latent`): small convolutional
networks, trained on rendered scenes by `scripts/train_shapes_reward.py`, that read the colour, shape, count and
position of a scene from its image or from its `builtin:tiny-shapes` VAE latents; their loading and their
differentiable scores. On the models floor, so that both the rollout side's reward functions
(`miles.rollout.rm_hub.learned_shapes`) and the trainer's reward-gradient losses may use them (ARCHITECTURE §3).

The score of a sample is the mean over the four attributes of the predicted probability of the class its prompt
asks for: the same meaning as the programmatic `shapes` reward (the mean of four attribute scores), which stays the
gold. It is a differentiable function of the input (`score_images`, `score_latents`); the weights ship in
`miles/assets/shapes_reward/` (docs/user-guide/rewards.md).
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from miles.data.shapes import COUNTS, PALETTE, POSITIONS, SHAPES
from miles.models.builtin import resolve_checkpoint
from miles.models.shapes_reward.weights import IMAGE, LATENT, WEIGHT_FILES, WEIGHTS_DIR, weights_dir
from miles.utils.simulation import real_tensors

# The heads, in the order of the network's output: (attribute, its classes, the metadata value of each class).
ATTRIBUTES: tuple[tuple[str, tuple[Any, ...]], ...] = (
    ("color", tuple(PALETTE)),
    ("shape", SHAPES),
    ("count", COUNTS),
    ("position", POSITIONS),
)
IMAGE_SIZE = 32  # the shapes world's resolution; other square images are resized to it (differentiably)
LATENT_CHECKPOINT = "builtin:tiny-shapes"  # the latent variant scores this checkpoint's normalised VAE latents


class ShapesRewardNet(nn.Module):
    """A 3x3 convolution, stride-2 convolutions down to 4x4, and an MLP with one logit per class of every attribute.

    Flattening the 4x4 map (no global pooling) keeps where the ink is, which the position head needs.
    """

    def __init__(self, in_channels: int, size: int, width: int = 32, hidden: int = 128):
        super().__init__()
        downs = int(math.log2(size // 4))
        if size < 4 or 4 * 2**downs != size:
            raise ValueError(f"ShapesRewardNet needs a square input of side 4 * 2**k, got {size}")
        layers: list[nn.Module] = [nn.Conv2d(in_channels, width, 3, padding=1), nn.SiLU()]
        channels = width
        for _ in range(downs):
            layers += [nn.Conv2d(channels, 2 * width, 3, stride=2, padding=1), nn.SiLU()]
            channels = 2 * width
        self.features = nn.Sequential(*layers)
        self.head = nn.Sequential(
            nn.Flatten(), nn.Linear(channels * 16, hidden), nn.SiLU(), nn.Linear(hidden, num_classes())
        )
        self.config = {"in_channels": in_channels, "size": size, "width": width, "hidden": hidden}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def num_classes() -> int:
    return sum(len(classes) for _, classes in ATTRIBUTES)


def split_logits(logits: torch.Tensor) -> dict[str, torch.Tensor]:
    """(B, 15) logits -> {attribute: (B, its classes)}."""
    sizes = [len(classes) for _, classes in ATTRIBUTES]
    return dict(zip([name for name, _ in ATTRIBUTES], logits.split(sizes, dim=1)))


def scene_labels(metadatas: Sequence[dict[str, Any]]) -> torch.Tensor:
    """(B, 4) class indices of each prompt's colour, shape, count and position (`ShapeScene` metadata keys)."""
    rows = []
    for metadata in metadatas:
        row = []
        for name, classes in ATTRIBUTES:
            if not isinstance(metadata, dict) or name not in metadata or metadata[name] not in classes:
                got = metadata.get(name) if isinstance(metadata, dict) else metadata
                raise ValueError(
                    f"shapes_learned needs shapes metadata with {name!r} in {list(classes)}, got {got!r} "
                    "(prompts from builtin:shapes or write_shapes_jsonl)"
                )
            row.append(classes.index(metadata[name]))
        rows.append(row)
    return torch.tensor(rows, dtype=torch.long).reshape(len(rows), len(ATTRIBUTES))


def wanted_probabilities(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(B, 4): per attribute, the softmax probability of the class `labels` asks for."""
    heads = split_logits(logits).values()
    labels = labels.to(logits.device)
    return torch.stack([h.softmax(dim=1).gather(1, labels[:, [k]])[:, 0] for k, h in enumerate(heads)], dim=1)


@functools.cache
def _cpu_net(kind: str, folder: str) -> tuple[ShapesRewardNet, dict[str, str]]:
    from safetensors import safe_open

    path = Path(folder) / WEIGHT_FILES[kind]
    if not path.is_file():
        raise FileNotFoundError(
            f"--rm-type {reward_name(kind)}: its weights {path} are missing; the package ships them in {WEIGHTS_DIR} "
            "(--shapes-learned-dir names another folder), or rebuild them with python scripts/train_shapes_reward.py"
        )
    with real_tensors(), safe_open(str(path), framework="pt") as f:  # cached: real even when the planner loads it
        metadata = f.metadata() or {}
        state = {key: f.get_tensor(key) for key in f.keys()}
        net = ShapesRewardNet(**json.loads(metadata["config"]))
        net.load_state_dict(state)
    return net.eval().requires_grad_(False), metadata


def reward_name(kind: str) -> str:
    return "shapes_learned" if kind == IMAGE else "shapes_learned_latent"


def load_net(kind: str, device: torch.device | str = "cpu", folder: str | None = None) -> ShapesRewardNet:
    """The network of `kind` (image or latent) from `folder` (None: the shipped one), frozen, on `device` (loaded
    once per process, folder and device)."""
    return _net_on(kind, str(torch.device(device)), str(weights_dir(folder)))


@functools.cache
def _net_on(kind: str, device: str, folder: str) -> ShapesRewardNet:
    net = _cpu_net(kind, folder)[0]
    return net if device == "cpu" else _copy_to(net, device)


def _copy_to(net: ShapesRewardNet, device: str) -> ShapesRewardNet:
    copy = ShapesRewardNet(**net.config)
    copy.load_state_dict(net.state_dict())
    return copy.to(device).eval().requires_grad_(False)


def shipped_metadata(kind: str, folder: str | None = None) -> dict[str, str]:
    """The weights file's metadata: config, seed, the training command, held-out accuracy per attribute (JSON)."""
    return dict(_cpu_net(kind, str(weights_dir(folder)))[1])


def _resized(pixels: torch.Tensor) -> torch.Tensor:
    if pixels.ndim != 4 or pixels.shape[1] != 3 or pixels.shape[2] != pixels.shape[3]:
        raise ValueError(f"shapes_learned scores square RGB images (B, 3, S, S) in [0, 1], got {tuple(pixels.shape)}")
    if pixels.shape[-1] == IMAGE_SIZE:
        return pixels
    return nn.functional.interpolate(pixels, size=(IMAGE_SIZE, IMAGE_SIZE), mode="bilinear", antialias=True)


def score_images(pixels: torch.Tensor, metadatas: Sequence[dict[str, Any]], folder: str | None = None) -> torch.Tensor:
    """(B,) scores in [0, 1] of images (B, 3, S, S) in [0, 1] (any float dtype, any device) against their prompts'
    shapes metadata: the mean over attributes of the probability of the wanted class. Differentiable in `pixels`.
    `folder`: the weights' (None: the shipped ones)."""
    x = _resized(pixels).float()
    logits = load_net(IMAGE, x.device, folder)(x * 2 - 1)
    return wanted_probabilities(logits, scene_labels(metadatas)).mean(dim=1)


def score_latents(
    latents: torch.Tensor, metadatas: Sequence[dict[str, Any]], folder: str | None = None
) -> torch.Tensor:
    """(B,) scores in [0, 1] of `builtin:tiny-shapes` normalised latents (B, 4, 16, 16), x0 = (z - shift) * scale as
    the engine's final latents, against the prompts' shapes metadata. Differentiable in `latents`."""
    net = load_net(LATENT, latents.device, folder)
    expected = (net.config["in_channels"], net.config["size"], net.config["size"])
    if tuple(latents.shape[1:]) != expected:
        raise ValueError(
            f"shapes_learned_latent scores {LATENT_CHECKPOINT} latents (B, {', '.join(map(str, expected))}), got "
            f"{tuple(latents.shape)}: another checkpoint's latents mean nothing to it (use shapes_learned on images)"
        )
    return wanted_probabilities(net(latents.float()), scene_labels(metadatas)).mean(dim=1)


@functools.lru_cache(maxsize=1)
def shapes_vae() -> Any:
    """The `builtin:tiny-shapes` VAE (frozen, CPU), loaded once per process."""
    from diffusers import AutoencoderKL  # here: diffusers takes seconds to import, only the latent path needs it

    folder = resolve_checkpoint(LATENT_CHECKPOINT)
    return AutoencoderKL.from_pretrained(folder, subfolder="vae").eval().requires_grad_(False)


def encode_images(pixels: torch.Tensor) -> torch.Tensor:
    """`builtin:tiny-shapes` normalised latents (posterior mode) of images (B, 3, 32, 32) in [0, 1]: what the
    model's `encode_images` gives."""
    from miles.models.diffusers_family import encode_shift_scaled  # here: it imports diffusers (seconds)

    return encode_shift_scaled(shapes_vae(), _resized(pixels) * 2 - 1, None)
