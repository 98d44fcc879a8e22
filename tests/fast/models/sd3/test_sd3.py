"""The SD3 family against independent computations: hand-run encoders, plain transformer calls, the diffusers loop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from diffusers import StableDiffusion3Pipeline
from safetensors.torch import load_file

from miles.models import Conditioning, SD3PipelineConfig, get_train_pipeline_config

PROMPTS = ["two red circles on the left", "a blue square", "Zebra at the TOP!"]


@pytest.fixture(scope="module")
def config(tiny_pipeline_dir) -> SD3PipelineConfig:
    return get_train_pipeline_config(tiny_pipeline_dir)


@pytest.fixture(scope="module")
def pipe(tiny_pipeline_dir) -> StableDiffusion3Pipeline:
    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_pipeline_dir, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_geometry_read_from_folder(config):
    assert config.scheduler_shift == 3.0
    assert config.vae_scale_factor == 4
    assert config.default_resolution == 32
    assert config.latent_shape() == (4, 8, 8)
    assert config.latent_shape(64) == (4, 16, 16)
    with pytest.raises(ValueError, match="multiple of 8"):
        config.latent_shape(36)


def test_load_transformer_from_pipeline_or_transformer_folder(config, tiny_pipeline_dir, tmp_path):
    a = config.load_transformer()
    a.save_pretrained(tmp_path / "t")
    b = config.load_transformer(str(tmp_path / "t"))
    assert not a.training and not b.training
    assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())
    assert config.transformer_blocks(a) == list(a.transformer_blocks) and len(config.transformer_blocks(a)) == 2
    assert config.load_transformer(dtype=torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(FileNotFoundError, match="config.json"):
        config.load_transformer(str(tmp_path))


def test_save_hf_gathers_each_entry_in_the_dtype_of_the_source_checkpoint(config, tiny_pipeline_dir):
    from safetensors import safe_open

    dtypes = config.saved_transformer_dtypes()
    assert set(dtypes) == set(config.load_transformer().state_dict())
    with safe_open(f"{tiny_pipeline_dir}/transformer/diffusion_pytorch_model.safetensors", framework="pt") as f:
        assert {k: f.get_tensor(k).dtype for k in f.keys()} == dtypes


@torch.no_grad()
def _encode_by_hand(pipe: StableDiffusion3Pipeline, prompts: list[str], t5_length: int) -> Conditioning:
    clip_seq, clip_pooled = [], []
    for tokenizer, encoder in ((pipe.tokenizer, pipe.text_encoder), (pipe.tokenizer_2, pipe.text_encoder_2)):
        ids = tokenizer(prompts, padding="max_length", max_length=77, truncation=True, return_tensors="pt").input_ids
        out = encoder(ids, output_hidden_states=True)
        clip_seq.append(out.hidden_states[-2])  # SD3 takes the penultimate CLIP layer
        clip_pooled.append(out.text_embeds)
    ids = pipe.tokenizer_3(prompts, padding="max_length", max_length=t5_length, truncation=True, return_tensors="pt")
    t5 = pipe.text_encoder_3(ids.input_ids).last_hidden_state
    clip = F.pad(torch.cat(clip_seq, dim=-1), (0, t5.shape[-1] - 64))
    pooled = torch.cat(clip_pooled, dim=-1)
    return Conditioning({"prompt_embeds": torch.cat([clip, t5], dim=1), "pooled_prompt_embeds": pooled})


def test_encode_prompts_matches_hand_computation_and_pipeline_encode_prompt(config, pipe):
    ours = config.encode_prompts(PROMPTS)
    assert ours["prompt_embeds"].shape == (3, 77 + 32, 64) and ours["pooled_prompt_embeds"].shape == (3, 64)
    hand = _encode_by_hand(pipe, PROMPTS, t5_length=32)
    torch.testing.assert_close(ours["prompt_embeds"], hand["prompt_embeds"])
    torch.testing.assert_close(ours["pooled_prompt_embeds"], hand["pooled_prompt_embeds"])
    with torch.no_grad():
        ref, _, ref_pooled, _ = pipe.encode_prompt(
            PROMPTS, None, None, do_classifier_free_guidance=False, max_sequence_length=32, device=torch.device("cpu")
        )
    torch.testing.assert_close(ours["prompt_embeds"], ref)
    torch.testing.assert_close(ours["pooled_prompt_embeds"], ref_pooled)
    assert not ours["prompt_embeds"].requires_grad


def test_negative_embeddings_equal_encoding_empty_prompts(config):
    negative = config.encode_negative(3)
    empty = config.encode_prompts([""] * 3)
    torch.testing.assert_close(negative["prompt_embeds"], empty["prompt_embeds"])
    torch.testing.assert_close(negative["pooled_prompt_embeds"], empty["pooled_prompt_embeds"])
    assert config.encode_negative(2)["prompt_embeds"].data_ptr() == negative["prompt_embeds"].data_ptr()  # cached
    other = config.encode_negative(1, "blurry")
    assert not torch.allclose(other["pooled_prompt_embeds"], negative["pooled_prompt_embeds"][:1])


def _inputs(config: SD3PipelineConfig, batch: int = 3):
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch, *config.latent_shape(), generator=g), torch.tensor([0.9, 0.5, 0.1])[:batch]


@torch.no_grad()
def test_predict_velocity_without_guidance_is_one_call_at_timestep_1000_sigma(config):
    transformer = config.load_transformer()
    latents, sigmas = _inputs(config)
    embeds = config.encode_prompts(PROMPTS)
    direct = transformer(
        hidden_states=latents,
        timestep=torch.tensor([900.0, 500.0, 100.0]),
        encoder_hidden_states=embeds["prompt_embeds"],
        pooled_projections=embeds["pooled_prompt_embeds"],
    ).sample
    ours = config.predict_velocity(transformer, latents, sigmas, embeds)
    assert ours.dtype == torch.float32 and ours.shape == latents.shape
    torch.testing.assert_close(ours, direct)


@torch.no_grad()
def test_predict_velocity_with_guidance_combines_two_separate_calls(config):
    transformer = config.load_transformer()
    latents, sigmas = _inputs(config)
    embeds, negative = config.encode_prompts(PROMPTS), config.encode_negative(3)

    def call(e: Conditioning) -> torch.Tensor:
        return transformer(
            hidden_states=latents,
            timestep=sigmas * 1000,
            encoder_hidden_states=e["prompt_embeds"],
            pooled_projections=e["pooled_prompt_embeds"],
        ).sample

    cond, uncond = call(embeds), call(negative)
    ours = config.predict_velocity(transformer, latents, sigmas, embeds, guidance_scale=4.5, negative=negative.rows(0))
    torch.testing.assert_close(ours, uncond + 4.5 * (cond - uncond), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="negative"):
        config.predict_velocity(transformer, latents, sigmas, embeds, guidance_scale=4.5)


@torch.no_grad()
def test_euler_loop_with_predict_velocity_reproduces_the_diffusers_pipeline(config, pipe):
    latents, _ = _inputs(config, batch=2)
    prompts = PROMPTS[:2]
    expected = pipe(
        prompts,
        num_inference_steps=3,
        guidance_scale=3.0,
        latents=latents.clone(),
        max_sequence_length=32,
        output_type="latent",
    ).images
    transformer, scheduler = config.load_transformer(), config.load_scheduler()
    scheduler.set_timesteps(3)
    sigmas = scheduler.sigmas  # shifted by the folder's shift=3
    embeds, negative = config.encode_prompts(prompts), config.encode_negative(2)
    x = latents
    for i in range(3):
        v = config.predict_velocity(transformer, x, sigmas[i].expand(2), embeds, guidance_scale=3.0, negative=negative)
        x = x + (sigmas[i + 1] - sigmas[i]) * v
    torch.testing.assert_close(x, expected, rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_vae_encode_decode_shapes_ranges_and_normalization(config):
    images = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    x0 = config.encode_images(images)
    assert x0.shape == (2, 4, 8, 8) and x0.dtype == torch.float32
    vae = config.load_vae()
    shift, scale = vae.config.shift_factor, vae.config.scaling_factor
    z = vae.encode(images).latent_dist.mode()
    torch.testing.assert_close(x0, (z - shift) * scale)
    media = config.decode_latents(x0)
    decoded = media.images
    assert (
        not media.is_video
        and media.audio is None
        and decoded.shape == (2, 3, 32, 32)
        and 0 <= decoded.min()
        and decoded.max() <= 1
    )
    torch.testing.assert_close(decoded, ((vae.decode(z).sample + 1) / 2).clamp(0, 1), rtol=1e-4, atol=1e-5)
    sampled = [config.encode_images(images, generator=torch.Generator().manual_seed(7)) for _ in range(2)]
    torch.testing.assert_close(sampled[0], sampled[1])
    assert not torch.allclose(sampled[0], x0)


def test_save_transformer_round_trip_loads_in_plain_diffusers(config, tiny_pipeline_dir, tmp_path):
    state = {k: v + 0.01 * torch.randn_like(v) for k, v in config.load_transformer().state_dict().items()}
    out = config.save_transformer(state, str(tmp_path / "saved"))
    reloaded = StableDiffusion3Pipeline.from_pretrained(out, local_files_only=True)
    reloaded.set_progress_bar_config(disable=True)
    assert all(torch.equal(reloaded.transformer.state_dict()[k], state[k]) for k in state)
    original_vae = load_file(f"{tiny_pipeline_dir}/vae/diffusion_pytorch_model.safetensors")
    assert all(torch.equal(reloaded.vae.state_dict()[k], v) for k, v in original_vae.items())
    image = reloaded("a red circle", num_inference_steps=2, guidance_scale=2.0, output_type="pt").images
    assert image.shape == (1, 3, 32, 32) and torch.isfinite(image).all()
    # saving again over the same folder replaces the weights
    config.save_transformer({k: v * 0 for k, v in state.items()}, out)
    assert all((v == 0).all() for v in load_file(f"{out}/transformer/diffusion_pytorch_model.safetensors").values())


def test_save_transformer_saves_views_into_larger_storages(config, tmp_path):
    # gathered FSDP2 parameters whose first dimension the shards padded are views of a padded buffer
    state = config.load_transformer().state_dict()
    padded = {k: torch.cat([v, torch.zeros(1, *v.shape[1:])]) if v.ndim else v.clone() for k, v in state.items()}
    views = {k: padded[k][: v.shape[0]] if v.ndim else padded[k] for k, v in state.items()}
    out = config.save_transformer(views, str(tmp_path / "saved"))
    saved = load_file(f"{out}/transformer/diffusion_pytorch_model.safetensors")
    assert all(torch.equal(saved[k], v) for k, v in state.items())


def test_save_transformer_rejects_wrong_keys_and_own_source(config, tiny_pipeline_dir, tmp_path):
    state = config.load_transformer().state_dict()
    with pytest.raises(ValueError, match="missing.*pos_embed"):
        config.save_transformer({k: v for k, v in state.items() if "pos_embed" not in k}, str(tmp_path / "a"))
    with pytest.raises(ValueError, match="unexpected.*extra"):
        config.save_transformer({**state, "extra": torch.zeros(1)}, str(tmp_path / "b"))
    with pytest.raises(ValueError, match="overwrite"):
        config.save_transformer(state, tiny_pipeline_dir)
