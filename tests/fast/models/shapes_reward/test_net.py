"""The learned shapes reward networks: the shipped weights, the score's range, agreement with the programmatic gold
on rendered scenes, weights from another folder, and the errors."""

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import miles
from miles.arguments.reward_spec import SHAPES_LEARNED_FILES
from miles.data.shapes import COUNTS, PALETTE, POSITIONS, SHAPES, shapes_items
from miles.models.shapes_reward import net as ls
from miles.rollout.rm_hub.shapes import shapes_reward

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


def test_agreement_with_the_programmatic_gold(scenes):
    gold = torch.tensor([score.all_correct for score in shapes_reward(scenes["images"], scenes["metadatas"])])
    x = scenes["pixels"]
    image_logits = ls.load_net(ls.IMAGE)(x * 2 - 1)
    latent_logits = ls.load_net(ls.LATENT)(scenes["latents"])
    for logits in (image_logits, latent_logits):
        agreement = (_learned_all_correct(logits, scenes["metadatas"]) == gold).float().mean()
        assert agreement >= AGREEMENT_FLOOR


def test_a_larger_image_is_scored_at_the_worlds_resolution():
    item = shapes_items(1, seed=3, split="eval", resolution=64)[0]
    pixels = torch.from_numpy(np.asarray(item["image"], dtype=np.float32) / 255).permute(2, 0, 1)[None]
    assert float(ls.score_images(pixels, [item["metadata"]])[0]) > 0.5


def test_errors_name_what_is_wrong(scenes):
    with pytest.raises(ValueError, match=r"builtin:tiny-shapes latents \(B, 4, 16, 16\)"):
        ls.score_latents(torch.zeros(1, 16, 8, 8), scenes["metadatas"][:1])
    with pytest.raises(ValueError, match="'shape' in"):
        ls.score_images(scenes["pixels"][:1], [{"color": "red", "count": 1, "position": "left"}])
    with pytest.raises(ValueError, match=r"square RGB images"):
        ls.score_images(torch.zeros(1, 3, 32, 16), scenes["metadatas"][:1])


def test_weights_from_another_folder_load_separately(tmp_path):
    for kind in (ls.IMAGE, ls.LATENT):
        (tmp_path / ls.WEIGHT_FILES[kind]).write_bytes((ls.WEIGHTS_DIR / ls.WEIGHT_FILES[kind]).read_bytes())
    assert ls.load_net(ls.IMAGE, folder=str(tmp_path)) is not ls.load_net(ls.IMAGE)
    x = torch.randn(2, 3, 32, 32)
    assert torch.equal(ls.load_net(ls.IMAGE, folder=str(tmp_path))(x), ls.load_net(ls.IMAGE)(x))
    (tmp_path / ls.WEIGHT_FILES[ls.LATENT]).unlink()
    with pytest.raises(FileNotFoundError, match="--rm-type shapes_learned_latent: its weights .* are missing"):
        ls.load_net(ls.LATENT, folder=str(tmp_path))


def test_weight_file_names_are_the_arguments_ones():
    assert {ls.reward_name(kind): name for kind, name in ls.WEIGHT_FILES.items()} == SHAPES_LEARNED_FILES


def test_the_net_loaded_first_under_the_planners_fake_tensors_stays_real_for_a_later_real_run():
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    ls._cpu_net.cache_clear()
    ls._net_on.cache_clear()
    with FakeTensorMode(allow_non_fake_inputs=True):  # the planner simulates on the CPU device
        planned = ls.load_net(ls.IMAGE)  # cached per process: a fake net would serve every later call
    assert not any(isinstance(p, FakeTensor) for p in planned.parameters())
    assert ls.load_net(ls.IMAGE) is planned
