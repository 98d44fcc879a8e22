"""The family contract against each family's own diffusers pipeline (every case of `FAMILY_CASES` in conftest):
the velocity its denoising loop feeds the scheduler, and the engine's ODE sampling end to end.

Whole training runs of the same cases are in `tests/e2e/test_family_contract.py`.
"""

from __future__ import annotations

import functools

import diffusers
import pytest
import torch

from miles.models import get_train_pipeline_config
from miles.rollout.engine import DiffusionEngine, GenerateRequest

PROMPTS = ["two red circles on the left", "a blue square"]
SEEDS = [3, 11]
GUIDANCE = [1.0, 3.5]  # without and with the family's guidance
TOLERANCE = 1e-5  # fp32; measured: 0 (SD3, FLUX guidance embedding), ~1e-6 (batched vs sequential CFG branches)


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
    try:
        latents = pipe(
            PROMPTS,
            num_inference_steps=num_steps,
            generator=[torch.Generator().manual_seed(s) for s in SEEDS],
            output_type="latent",
            **case.cfg_kwargs(guidance),
            **case.pipeline_kwargs,
        )
        latents = getattr(latents, case.output_attr)
    finally:
        del pipe.scheduler.step
    unpack = functools.partial(case.to_family_latents, pipe, resolution=case.resolution)
    return unpack(latents), [(unpack(v), unpack(x)) for v, x in steps], pipe.scheduler.sigmas.float().clone()


@pytest.mark.parametrize("guidance", GUIDANCE)
def test_predict_velocity_is_what_the_pipeline_steps_with(family_case, guidance):
    case, path = family_case
    _, steps, sigmas = run_pipeline(case, path, guidance, num_steps=2)
    family = get_train_pipeline_config(path, **case.family_options)
    assert family.name == case.family
    transformer = family.load_transformer()
    embeds = family.encode_prompts(PROMPTS)
    negative = family.encode_negative(len(PROMPTS), "") if guidance > 1 else None
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
        )
    )
    assert torch.equal(result.sigmas, sigmas), (result.sigmas, sigmas)  # the pipeline's grid (FLUX: shifted by mu)
    assert result.final_latents.shape == expected.shape
    assert (result.final_latents - expected.float()).abs().max().item() <= TOLERANCE
    assert result.images.shape == (len(PROMPTS), *case.media_shape)
