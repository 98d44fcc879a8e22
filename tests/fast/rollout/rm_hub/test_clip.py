"""clip_score and pickscore on a tiny random CLIP saved to a temp folder, checked against the model's own forward."""

import asyncio

import numpy as np
import pytest
import torch

from miles.arguments.parser import default_args
from miles.rollout.rm_hub import RewardError, compute_rewards
from miles.rollout.rm_hub import clip as clip_module
from miles.rollout.rm_hub.clip import clip_score, load_clip, pickscore
from miles.utils.types import Sample

PROMPTS = ["a red circle on the left", "two blue squares on the top", "three green triangles", "a cat", "x"]


def build_tiny_clip(path: str) -> None:
    from transformers import (
        CLIPConfig,
        CLIPImageProcessor,
        CLIPModel,
        CLIPProcessor,
        CLIPTextConfig,
        CLIPTokenizer,
        CLIPVisionConfig,
    )

    letters = "abcdefghijklmnopqrstuvwxyz"
    vocab = {c: i for i, c in enumerate(letters)}
    vocab.update({c + "</w>": len(letters) + i for i, c in enumerate(letters)})
    vocab.update({"<|startoftext|>": len(vocab), "<|endoftext|>": len(vocab) + 1})
    merges = [("r", "e"), ("re", "d</w>"), ("a", "t</w>")]
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    tokenizer = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77)
    image_processor = CLIPImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
    eos = vocab["<|endoftext|>"]
    text = CLIPTextConfig(
        vocab_size=len(vocab),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=77,
        bos_token_id=vocab["<|startoftext|>"],
        eos_token_id=eos,
        pad_token_id=eos,
    )
    vision = CLIPVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=16, patch_size=8
    )
    torch.manual_seed(0)
    model = CLIPModel(CLIPConfig(text_config=text.to_dict(), vision_config=vision.to_dict(), projection_dim=8))
    model.save_pretrained(path)
    CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(path)


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_clip") / "clip"
    build_tiny_clip(str(path))
    return str(path)


def make_samples():
    rng = np.random.default_rng(0)
    return [
        Sample(index=i, prompt=p, image=rng.integers(0, 256, size=(24, 24, 3), dtype=np.uint8))
        for i, p in enumerate(PROMPTS)
    ]


def reference_cosine(path, samples, with_image_embeds=False):
    """Cosine from the model's full forward (its normalised embeds), not from the reward's feature calls."""
    from PIL import Image
    from transformers import CLIPModel, CLIPProcessor

    model, processor = CLIPModel.from_pretrained(path).eval(), CLIPProcessor.from_pretrained(path)
    inputs = processor(
        text=[s.prompt for s in samples],
        images=[Image.fromarray(s.image) for s in samples],
        return_tensors="pt",
        padding=True,
    )
    with torch.no_grad():
        out = model(**inputs)
    cosine = torch.nn.functional.cosine_similarity(out.image_embeds, out.text_embeds, dim=-1)
    assert torch.allclose(out.logits_per_image.diagonal(), model.logit_scale.exp() * cosine, atol=1e-5)
    if with_image_embeds:
        return cosine, out.image_embeds / out.image_embeds.norm(dim=-1, keepdim=True)
    return cosine, model.logit_scale.exp().item()


def test_clip_score_is_the_image_text_cosine(clip_dir):
    samples = make_samples()
    values = asyncio.run(clip_score(default_args(clip_model_path=clip_dir), samples))
    expected, _ = reference_cosine(clip_dir, samples)
    assert len(values) == len(samples) and np.isfinite(values).all()
    assert values == pytest.approx(expected.tolist(), abs=1e-5)


def test_each_sample_keeps_its_unit_image_embedding_for_the_diversity_monitor(clip_dir):
    samples = make_samples()
    asyncio.run(clip_score(default_args(clip_model_path=clip_dir), samples))
    _, expected = reference_cosine(clip_dir, samples, with_image_embeds=True)
    kept = np.stack([s.extra["clip_image_embedding"] for s in samples])
    assert kept.dtype == np.float32 and kept.shape == tuple(expected.shape)
    assert np.allclose(kept, expected.numpy(), atol=1e-6)


def test_pickscore_is_logit_scale_times_cosine(clip_dir):
    samples = make_samples()
    values = asyncio.run(pickscore(default_args(pickscore_model_path=clip_dir), samples))
    cosine, scale = reference_cosine(clip_dir, samples)
    assert values == pytest.approx((scale * cosine).tolist(), abs=1e-4)


def test_chunked_scoring_matches_one_batch(clip_dir, monkeypatch):
    samples = make_samples()
    args = default_args(clip_model_path=clip_dir)
    whole = asyncio.run(clip_score(args, samples))
    monkeypatch.setattr(clip_module, "CLIP_BATCH_SIZE", 2)
    assert asyncio.run(clip_score(args, samples)) == pytest.approx(whole, abs=1e-5)


def test_model_is_loaded_once_per_process(clip_dir):
    assert load_clip(clip_dir, "--clip-model-path")[0] is load_clip(clip_dir, "--clip-model-path")[0]


def test_missing_or_wrong_path_names_the_flag(tmp_path):
    samples = make_samples()[:2]
    with pytest.raises(RewardError, match=r"'clip_score' raised on sample index=0.*--clip-model-path is required"):
        asyncio.run(compute_rewards(default_args(), samples, [("clip_score", 1.0)]))
    args = default_args(pickscore_model_path=str(tmp_path / "missing"))
    with pytest.raises(RewardError, match=r"--pickscore-model-path '.*missing' is not a folder"):
        asyncio.run(compute_rewards(args, samples, [("pickscore", 1.0)]))
    with pytest.raises(ValueError, match=r"--pickscore-model-path .*cannot load a CLIP processor"):
        load_clip(str(tmp_path), "--pickscore-model-path")
