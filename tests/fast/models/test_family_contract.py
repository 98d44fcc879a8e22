"""The family contract against each family's own diffusers pipeline (every case of `FAMILY_CASES` in family_cases.py):
the velocity its denoising loop feeds the scheduler, the engine's ODE sampling end to end, and a LoRA adapter on the
family's default targets, saved as `--use-lora --save-hf` saves it, loading through the pipeline's
`load_lora_weights`.

Whole training runs of the same cases are in `tests/e2e/test_family_contract.py`.
"""

from __future__ import annotations

import functools

import diffusers
import numpy as np
import pytest
import torch
from PIL import Image

from miles.arguments.parser import default_args
from miles.backends.fsdp_utils.lora import apply_lora, lora_config_from_args, lora_state_dict, save_lora_adapter
from miles.models import get_train_pipeline_config
from miles.models.conditioning import Conditioning
from miles.rollout.engine import DiffusionEngine
from miles.rollout.engine_api import GenerateRequest
from tests.fast.models.family_cases import FAMILY_CASES, case_params

PROMPTS = ["two red circles on the left", "a blue square"]
SEEDS = [3, 11]
GUIDANCE = [1.0, 3.5]  # without and with the family's guidance
TOLERANCE = 1e-5  # fp32; measured: 0 (SD3, FLUX guidance embedding), ~1e-6 (batched vs sequential CFG branches)


def source_images(case) -> list[list[np.ndarray]] | None:
    """`case.source_images` seeded (H, W, 3) uint8 images per prompt at the case's resolution (None: text only):
    smooth colour fields, so that a VAE's encoding of them is not all noise."""
    if not case.source_images:
        return None
    rng = np.random.default_rng(7)
    side = case.resolution
    ramp = np.linspace(0.0, 1.0, side)[:, None] * np.linspace(1.0, 0.0, side)[None, :]
    images = []
    for _ in PROMPTS:
        colours = rng.uniform(0, 255, size=(case.source_images, 1, 1, 3))
        noise = rng.uniform(-20, 20, size=(case.source_images, side, side, 3))
        pixels = np.clip(colours * (0.3 + 0.7 * ramp[None, :, :, None]) + noise, 0, 255).astype(np.uint8)
        images.append(list(pixels))
    return images


@functools.lru_cache(maxsize=4)
def _pipeline(pipeline_class: str, path: str):
    pipe = getattr(diffusers, pipeline_class).from_pretrained(path, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run_pipeline(case, path, guidance, num_steps):
    """The pipeline's own __call__ (latents out), recording what its loop hands the scheduler at each step."""
    pipe = _pipeline(case.pipeline_class, path)
    steps = []
    scheduler_step = type(pipe.scheduler).step

    def recording_step(scheduler, model_output, timestep, sample, *args, **kwargs):
        steps.append((model_output.detach().clone(), sample.detach().clone()))
        return scheduler_step(scheduler, model_output, timestep, sample, *args, **kwargs)

    pipe.scheduler.step = recording_step.__get__(pipe.scheduler)
    case.set_pipeline_guidance(pipe, guidance)
    sources = source_images(case)
    pil = None if sources is None else [[Image.fromarray(i) for i in s] for s in sources]

    def call(rows):
        images = {} if pil is None else case.image_kwargs([pil[i] for i in rows])
        output = pipe(
            prompt=[PROMPTS[i] for i in rows],
            num_inference_steps=num_steps,
            generator=[torch.Generator().manual_seed(SEEDS[i]) for i in rows],
            output_type="latent",
            **images,
            **case.cfg_kwargs(guidance),
            **case.pipeline_kwargs,
        )
        return case.output_latents(output)

    try:
        with case.call_context(path):
            if not case.per_prompt_calls:
                latents = call(range(len(PROMPTS)))
            else:  # each call's steps in turn: step i of prompt p is steps[p * num_steps + i]
                latents = torch.cat([call([p]) for p in range(len(PROMPTS))])
                steps = [tuple(torch.cat(t) for t in zip(*steps[i::num_steps])) for i in range(num_steps)]
    finally:
        del pipe.scheduler.step
    if case.scheduler_steps > 1:  # one step of each stream's scheduler per denoising step: group them
        n = case.scheduler_steps
        steps = [tuple(zip(*steps[i : i + n])) for i in range(0, len(steps), n)]
    unpack = functools.partial(case.to_family_latents, pipe, resolution=case.resolution)
    return unpack(latents), [(unpack(v), unpack(x)) for v, x in steps], pipe.scheduler.sigmas.float().clone()


@pytest.mark.parametrize("guidance", GUIDANCE)
def test_predict_velocity_is_what_the_pipeline_steps_with(family_case, guidance):
    case, path = family_case
    _, steps, sigmas = run_pipeline(case, path, guidance, num_steps=2)
    family = get_train_pipeline_config(path, **case.family_options)
    assert family.name == case.family
    transformer = family.load_transformer()
    embeds, negative = family.encode_request(PROMPTS, source_images(case), "", negative=guidance > 1)
    assert len(steps) == 2
    for i, (pipeline_velocity, sample) in enumerate(steps):
        with torch.no_grad():
            velocity = family.predict_velocity(
                transformer,
                sample,
                sigmas[i].expand(len(PROMPTS)),
                embeds,
                guidance_scale=guidance,
                negative=negative,
            )
        assert velocity.shape == (len(PROMPTS), *family.latent_shape(case.resolution))
        assert (velocity - pipeline_velocity.float()).abs().max().item() <= TOLERANCE, (case.id, guidance, i)


@pytest.mark.parametrize("guidance", GUIDANCE)
def test_engine_ode_sampling_reproduces_the_pipeline(family_case, guidance):
    case, path = family_case
    num_steps = 4
    expected, _, sigmas = run_pipeline(case, path, guidance, num_steps=num_steps)
    engine = DiffusionEngine(path, family_options=case.family_options)
    result = engine.generate(
        GenerateRequest(
            prompts=PROMPTS,
            seeds=SEEDS,
            num_steps=num_steps,
            guidance_scale=guidance,
            negative_prompt="",
            sde_type="ode",
            noise_level=0.0,
            trained_steps=[],
            resolution=case.resolution,
            source_images=source_images(case),
        )
    )
    assert torch.equal(result.sigmas, sigmas), (result.sigmas, sigmas)  # the pipeline's grid (FLUX: shifted by mu)
    assert result.final_latents.shape == expected.shape
    assert (result.final_latents - expected.float()).abs().max().item() <= TOLERANCE
    assert result.images.shape == (len(PROMPTS), *case.media_shape)


# encodings depend on the family's encoders, not on the configuration: one case per family
ONE_ENCODER_CASE_PER_FAMILY = [
    case for i, case in enumerate(FAMILY_CASES) if case.family not in {c.family for c in FAMILY_CASES[:i]}
]


@pytest.mark.parametrize(
    "case", case_params(ONE_ENCODER_CASE_PER_FAMILY), ids=[case.id for case in ONE_ENCODER_CASE_PER_FAMILY]
)
def test_a_prompt_encodes_alone_as_in_a_batch_where_the_family_says_its_cache_is_exact(request, case):
    """`prompt_cache_exact`, which lets `--prompt-cache auto` cache a family: each prompt's rows (with its source
    images) encoded alone, as the cache encodes them, equal its rows in the batch an uncached engine encodes."""
    path = request.getfixturevalue(case.fixture)
    family = get_train_pipeline_config(path, **case.family_options)
    if not family.prompt_cache_exact:
        pytest.skip(f"the {family.name} family does not declare prompt_cache_exact (its cache is off by default)")
    images = source_images(case)
    batch, _ = family.encode_request(PROMPTS, images, "", negative=False)
    alone = Conditioning.cat(
        [family.encode_request([p], None if images is None else [images[i]], "", negative=False)[0]
         for i, p in enumerate(PROMPTS)]
    )  # fmt: skip
    assert list(alone) == list(batch)
    assert all(torch.equal(alone[name], batch[name]) for name in batch), family.name


# the adapter depends on the family (its targets, its pipeline class), not on the configuration: one case per family
# whose pipeline class loads adapters (the others refuse --use-lora --save-hf:
# tests/fast/models/hunyuan_video15/test_hunyuan_video15.py)
ONE_CASE_PER_FAMILY = [
    case
    for i, case in enumerate(FAMILY_CASES)
    if case.loads_lora and case.family not in {c.family for c in FAMILY_CASES[:i]}
]


@pytest.mark.parametrize("case", case_params(ONE_CASE_PER_FAMILY), ids=[case.id for case in ONE_CASE_PER_FAMILY])
def test_default_lora_adapter_loads_through_the_pipelines_load_lora_weights(request, case, tmp_path):
    path = request.getfixturevalue(case.fixture)
    family = get_train_pipeline_config(path, **case.family_options)
    config = lora_config_from_args(default_args(lora_rank=4, lora_alpha=8), family.name)
    assert config["target_modules"] == list(family.default_lora_targets)  # no --lora-target-modules: the defaults
    model = apply_lora(family.load_transformer(), config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:  # lora_B starts at zero: give the adapter an effect, as training would
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
    embeds, _ = family.encode_request(PROMPTS, source_images(case), "", negative=False)
    latents = torch.randn(len(PROMPTS), *family.latent_shape(case.resolution), generator=gen)
    sigmas = torch.tensor([0.7, 0.3])
    # what the trainer's save_hf writes with --use-lora: the LoRA slice of the full state dict, for the family's class
    save_lora_adapter(lora_state_dict(model.state_dict()), config, tmp_path / "lora", family.pipeline_class_name)
    pipe = getattr(diffusers, case.pipeline_class).from_pretrained(path, local_files_only=True)
    pipe.load_lora_weights(str(tmp_path / "lora"))
    with torch.no_grad():
        adapted = family.predict_velocity(model, latents, sigmas, embeds)
        base = family.predict_velocity(family.load_transformer(), latents, sigmas, embeds)
        loaded = family.predict_velocity(pipe.transformer, latents, sigmas, embeds)
    assert (adapted - base).abs().max().item() > 1e-3, case.id  # the adapter changes the output
    torch.testing.assert_close(loaded, adapted, atol=1e-6, rtol=0)
