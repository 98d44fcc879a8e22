"""The learned shapes rewards (`shapes_learned`, `shapes_learned_latent`): the shipped weights, the score's range and
gradient, agreement with the programmatic gold on rendered scenes, the reward path and the differentiable
declaration."""

import asyncio
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import miles
from miles.arguments.parser import default_args
from miles.arguments.reward_spec import DIFFERENTIABLE_REWARDS, shapes_learned_problems
from miles.data.shapes import COUNTS, PALETTE, POSITIONS, SHAPES, shapes_items
from miles.rollout.rm_hub import REWARD_FUNCTIONS, compute_rewards, differentiable_of, reward_spec_from_args
from miles.rollout.rm_hub import learned_shapes as ls
from miles.rollout.rm_hub.shapes import shapes_reward
from miles.utils.types import Sample

NUM_SCENES = 64
AGREEMENT_FLOOR = 0.9  # share of (scene, prompt) pairs where the learned all-correct equals the gold's
_OTHERS = {"color": list(PALETTE), "shape": list(SHAPES), "count": list(COUNTS), "position": list(POSITIONS)}


@pytest.fixture(scope="module")
def scenes() -> dict:
    """64 held-out scenes, every other one with a prompt that differs from the scene in one attribute (cycled)."""
    items = shapes_items(NUM_SCENES, seed=7, split="eval")
    metadatas = []
    for i, item in enumerate(items):
        metadata = dict(item["metadata"])
        if i % 2:
            name = ls.ATTRIBUTES[(i // 2) % 4][0]
            choices = [value for value in _OTHERS[name] if value != metadata[name]]
            metadata[name] = choices[(i // 8) % len(choices)]
        metadatas.append(metadata)
    images = [np.asarray(item["image"]) for item in items]
    pixels = torch.from_numpy(np.stack(images).astype(np.float32) / 255).permute(0, 3, 1, 2)
    with torch.no_grad():
        latents = ls.encode_images(pixels)  # once: the VAE is the slow part
    return {"images": images, "pixels": pixels, "latents": latents, "metadatas": metadatas}


def _learned_all_correct(logits: torch.Tensor, metadatas: list[dict]) -> torch.Tensor:
    return (ls.wanted_probabilities(logits, ls.scene_labels(metadatas)) > 0.5).all(dim=1)


def test_shipped_weights_are_small_packaged_and_carry_their_recipe():
    package = Path(miles.__file__).parent
    for kind in (ls.IMAGE, ls.LATENT):
        path = ls.WEIGHTS_DIR / ls.WEIGHT_FILES[kind]
        assert path.relative_to(package).parts[0] == "assets"  # pyproject's package-data ships assets/**
        net = ls.load_net(kind)
        assert sum(p.numel() for p in net.parameters()) < 300_000
        assert not any(p.requires_grad for p in net.parameters())
        copy = ls._copy_to(net, "cpu")  # what another device gets (tests/fast-gpu runs it on CUDA)
        x = torch.randn(2, net.config["in_channels"], net.config["size"], net.config["size"])
        assert torch.equal(copy(x), net(x)) and not any(p.requires_grad for p in copy.parameters())
        metadata = ls.shipped_metadata(kind)
        assert metadata["seed"] == "0" and metadata["command"].startswith("python scripts/train_shapes_reward.py")
        assert set(json.loads(metadata["heldout_accuracy"])) and metadata["kind"] == kind


def test_docs_state_the_shipped_held_out_accuracies():
    page = (Path(miles.__file__).parents[1] / "docs" / "user-guide" / "rewards.md").read_text()
    for kind in (ls.IMAGE, ls.LATENT):
        for where, accuracies in json.loads(ls.shipped_metadata(kind)["heldout_accuracy"]).items():
            row = re.search(rf"\| `{ls.reward_name(kind)}` \| {re.escape(where)} \|([^\n]*)", page)
            assert row, f"rewards.md has no row for {ls.reward_name(kind)} on {where}"
            cells = [float(cell) for cell in row.group(1).strip(" |").split("|")]
            assert cells == pytest.approx([accuracies[name] for name in (*_OTHERS, "all")], abs=5e-4)


def test_scores_are_one_per_sample_in_the_unit_interval(scenes):
    images = ls.score_images(scenes["pixels"], scenes["metadatas"])
    latents = ls.score_latents(scenes["latents"], scenes["metadatas"])
    for scores in (images, latents):
        assert scores.shape == (NUM_SCENES,) and bool(((scores >= 0) & (scores <= 1)).all())
        # the true prompts (even rows) score above the prompts that differ in one attribute (odd rows)
        assert scores[0::2].mean() > scores[1::2].mean() + 0.1


@pytest.mark.parametrize("name", ["shapes_learned", "shapes_learned_latent"])
def test_gradient_in_the_input_is_finite_and_nonzero(scenes, name):
    declared = differentiable_of(REWARD_FUNCTIONS[name])  # what a reward-gradient algorithm calls
    inputs = scenes["pixels"][:8] if declared.inputs == ls.IMAGE else scenes["latents"][:8]
    inputs = inputs.clone().requires_grad_(True)
    declared.score(default_args(), inputs, scenes["metadatas"][:8]).sum().backward()
    grad = inputs.grad
    assert bool(torch.isfinite(grad).all())
    assert bool((grad.flatten(1).abs().amax(dim=1) > 0).all())  # every sample's score moves with its input


def test_agreement_with_the_programmatic_gold(scenes):
    gold = torch.tensor([score.all_correct for score in shapes_reward(scenes["images"], scenes["metadatas"])])
    x = scenes["pixels"]
    image_logits = ls.load_net(ls.IMAGE)(x * 2 - 1)
    latent_logits = ls.load_net(ls.LATENT)(scenes["latents"])
    for logits in (image_logits, latent_logits):
        agreement = (_learned_all_correct(logits, scenes["metadatas"]) == gold).float().mean()
        assert agreement >= AGREEMENT_FLOOR


def test_the_reward_path_scores_what_the_torch_scorers_give(scenes):
    args = default_args(rm_type="shapes_learned,shapes_learned_latent:0.5")
    samples = [
        Sample(index=i, prompt="", metadata=metadata, image=image)
        for i, (image, metadata) in enumerate(zip(scenes["images"][:6], scenes["metadatas"][:6]))
    ]
    totals, per_reward = asyncio.run(compute_rewards(args, samples, reward_spec_from_args(args)))
    x = scenes["pixels"][:6]
    with torch.no_grad():
        image = ls.score_images(x, scenes["metadatas"][:6])
        latent = ls.score_latents(scenes["latents"][:6], scenes["metadatas"][:6])
    assert per_reward["shapes_learned"] == pytest.approx(image.tolist(), abs=1e-5)
    assert per_reward["shapes_learned_latent"] == pytest.approx(latent.tolist(), abs=1e-5)
    assert totals == pytest.approx((image + 0.5 * latent).tolist(), abs=1e-5)


def test_a_larger_image_is_scored_at_the_worlds_resolution():
    item = shapes_items(1, seed=3, split="eval", resolution=64)[0]
    pixels = torch.from_numpy(np.asarray(item["image"], dtype=np.float32) / 255).permute(2, 0, 1)[None]
    assert float(ls.score_images(pixels, [item["metadata"]])[0]) > 0.5


def test_differentiable_declarations_agree_with_the_functions():
    for name, fn in REWARD_FUNCTIONS.items():
        declared = differentiable_of(fn)
        assert (declared.inputs if declared else None) == DIFFERENTIABLE_REWARDS.get(name), name
    latent = differentiable_of(REWARD_FUNCTIONS["shapes_learned_latent"])
    assert latent.latent_checkpoint == ls.LATENT_CHECKPOINT and latent.score is ls.differentiable_latents


def test_errors_name_what_is_wrong(scenes):
    with pytest.raises(ValueError, match=r"builtin:tiny-shapes latents \(B, 4, 16, 16\)"):
        ls.score_latents(torch.zeros(1, 16, 8, 8), scenes["metadatas"][:1])
    with pytest.raises(ValueError, match="'shape' in"):
        ls.score_images(scenes["pixels"][:1], [{"color": "red", "count": 1, "position": "left"}])
    with pytest.raises(ValueError, match=r"square RGB images"):
        ls.score_images(torch.zeros(1, 3, 32, 16), scenes["metadatas"][:1])


def test_weights_from_another_folder(scenes, tmp_path):
    for kind in (ls.IMAGE, ls.LATENT):  # a copy of the shipped files scores the same through the flag
        (tmp_path / ls.WEIGHT_FILES[kind]).write_bytes((ls.WEIGHTS_DIR / ls.WEIGHT_FILES[kind]).read_bytes())
    args = default_args(rm_type="shapes_learned", shapes_learned_dir=str(tmp_path))
    samples = [Sample(index=0, prompt="", metadata=scenes["metadatas"][0], image=scenes["images"][0])]
    _, per_reward = asyncio.run(compute_rewards(args, samples, reward_spec_from_args(args)))
    assert per_reward["shapes_learned"][0] == pytest.approx(
        float(ls.score_images(scenes["pixels"][:1], [samples[0].metadata])[0]), abs=1e-6
    )
    assert ls.load_net(ls.IMAGE, folder=str(tmp_path)) is not ls.load_net(ls.IMAGE)
    (tmp_path / ls.WEIGHT_FILES[ls.LATENT]).unlink()
    missing = default_args(rm_type="shapes_learned_latent", shapes_learned_dir=str(tmp_path))
    assert shapes_learned_problems(missing, reward_spec_from_args(missing)) == [
        f"--shapes-learned-dir {tmp_path}: no shapes_learned_latent.safetensors in it (--rm-type shapes_learned_latent "
        f"loads it; python scripts/train_shapes_reward.py --out-dir {tmp_path} writes it)"
    ]
