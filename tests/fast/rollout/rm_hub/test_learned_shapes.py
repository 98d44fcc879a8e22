"""The learned shapes rewards as reward functions: the reward path scores what the torch scorers give, with the
shipped weights or another folder's, and a folder without the weights is refused before any model loads."""

import asyncio

import numpy as np
import pytest
import torch

from miles.arguments.parser import default_args
from miles.arguments.reward_spec import shapes_learned_problems
from miles.data.shapes import shapes_items
from miles.rollout.rm_hub import compute_rewards, reward_spec_from_args
from miles.rollout.rm_hub import learned_shapes as ls
from miles.utils.types import Sample


@pytest.fixture(scope="module")
def scenes() -> dict:
    items = shapes_items(6, seed=7, split="eval")
    images = [np.asarray(item["image"]) for item in items]
    pixels = torch.from_numpy(np.stack(images).astype(np.float32) / 255).permute(0, 3, 1, 2)
    metadatas = [dict(item["metadata"]) for item in items]
    samples = [Sample(index=i, prompt="", metadata=m, image=im) for i, (im, m) in enumerate(zip(images, metadatas))]
    return {"samples": samples, "pixels": pixels, "metadatas": metadatas}


def test_the_reward_path_scores_what_the_torch_scorers_give(scenes):
    args = default_args(rm_type="shapes_learned,shapes_learned_latent:0.5")
    totals, per_reward = asyncio.run(compute_rewards(args, scenes["samples"], reward_spec_from_args(args)))
    with torch.no_grad():
        image = ls.score_images(scenes["pixels"], scenes["metadatas"])
        latent = ls.score_latents(ls.encode_images(scenes["pixels"]), scenes["metadatas"])
    assert per_reward["shapes_learned"] == pytest.approx(image.tolist(), abs=1e-5)
    assert per_reward["shapes_learned_latent"] == pytest.approx(latent.tolist(), abs=1e-5)
    assert totals == pytest.approx((image + 0.5 * latent).tolist(), abs=1e-5)


def test_weights_from_another_folder(scenes, tmp_path):
    for kind in (ls.IMAGE, ls.LATENT):  # a copy of the shipped files scores the same through the flag
        (tmp_path / ls.WEIGHT_FILES[kind]).write_bytes((ls.WEIGHTS_DIR / ls.WEIGHT_FILES[kind]).read_bytes())
    args = default_args(rm_type="shapes_learned", shapes_learned_dir=str(tmp_path))
    samples = scenes["samples"][:1]
    _, per_reward = asyncio.run(compute_rewards(args, samples, reward_spec_from_args(args)))
    assert per_reward["shapes_learned"][0] == pytest.approx(
        float(ls.score_images(scenes["pixels"][:1], [samples[0].metadata])[0]), abs=1e-6
    )
    (tmp_path / ls.WEIGHT_FILES[ls.LATENT]).unlink()
    missing = default_args(rm_type="shapes_learned_latent", shapes_learned_dir=str(tmp_path))
    assert shapes_learned_problems(missing, reward_spec_from_args(missing)) == [
        f"--shapes-learned-dir {tmp_path}: no shapes_learned_latent.safetensors in it (--rm-type shapes_learned_latent "
        f"loads it; python scripts/train_shapes_reward.py --out-dir {tmp_path} writes it)"
    ]


def test_the_shipped_fitted_proxies_are_named_builtin_fitted(scenes):
    """`--shapes-learned-dir builtin:fitted` scores with the shipped fitted weights (their own numbers, not the
    generator-only ones'); an unknown builtin name is refused at parse time naming the known ones."""
    args = default_args(rm_type="shapes_learned_latent", shapes_learned_dir="builtin:fitted")
    assert shapes_learned_problems(args, reward_spec_from_args(args)) == []
    assert "--model-samples 1024" in ls.shipped_metadata(ls.LATENT, "builtin:fitted")["command"]
    latents = ls.encode_images(scenes["pixels"])
    with torch.no_grad():
        fitted = ls.score_latents(latents, scenes["metadatas"], "builtin:fitted")
        shipped = ls.score_latents(latents, scenes["metadatas"])
    assert not torch.equal(fitted, shipped) and bool(((fitted >= 0) & (fitted <= 1)).all())
    unknown = default_args(rm_type="shapes_learned", shapes_learned_dir="builtin:nope")
    assert shapes_learned_problems(unknown, reward_spec_from_args(unknown)) == [
        "--shapes-learned-dir builtin:nope: no such shipped weights (known: ['builtin:fitted'])"
    ]
