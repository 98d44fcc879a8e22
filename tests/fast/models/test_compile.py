"""`--compile blocks` on the tiny SD3 pipeline: names and keys unchanged, the compiled engine against the eager one
(the same sampling within a measured tolerance), no recompile across batch sizes, CFG and in-place weight loads, and
the refusals. One compiled engine serves the module.

It compiles with the `aot_eager` backend ($MILES_COMPILE_BACKEND): dynamo's graphs, guards and recompiles as with
inductor, run with eager kernels, so the module costs seconds instead of inductor's ~40-70 s of code generation on
this CPU. Inductor's numbers are checked in the suite on the same blocks under FSDP2 with gradients (the `compile-ws2`
job of test_sharding.py) and on whole runs by tests/e2e/test_compile.py (`-m standard`); measured for the engine on
2026-12-04 with inductor: final latents 3.6e-7 from eager without CFG, 2.3e-6 with CFG 4.5, log-probs 1.2e-7, within
the bounds below."""

import os

import pytest
import torch

from miles.models.base import get_train_pipeline_config
from miles.models.compile import BACKEND_ENV, check_compile, compile_counters, compile_transformer
from miles.rollout.engine import DiffusionEngine
from miles.rollout.engine_api import GenerateRequest
from tests.fast.models.family_cases import FAMILY_CASES
from tests.fast.models.test_family_contract import PROMPTS as CONTRACT_PROMPTS
from tests.fast.models.test_family_contract import source_images as contract_source_images

# Compiled vs eager, the same weights and noise (inductor fuses and reorders fp32 sums): measured on this machine
# 2026-12-04, 3 prompts, 4 steps: final latents 3.6e-7 apart without CFG and 2.3e-6 with CFG 4.5 (which scales the
# velocity's rounding by 4.5), log-probs 1.2e-7 (2 threads); |latents| ~0.87 on average
LATENT_TOLERANCE = 1e-5
LOG_PROB_TOLERANCE = 1e-6


def request(prompts, guidance_scale=4.5, **overrides):
    values = dict(
        prompts=prompts,
        seeds=[11 + 11 * i for i in range(len(prompts))],
        num_steps=4,
        guidance_scale=guidance_scale,
        negative_prompt="",
        sde_type="sde",
        noise_level=0.7,
        trained_steps=[0, 1, 2],
        decode=False,
    )
    values.update(overrides)
    return GenerateRequest(**values)


PROMPTS = ["a red circle", "two blue squares on the left", "a green triangle"]


@pytest.fixture(scope="module")
def engines(tiny_pipeline_dir):
    """(eager, compiled) engines on one pipeline; the compiled one has generated a batch of 2 with CFG (its
    compile)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(BACKEND_ENV, "aot_eager")  # read when the blocks are compiled, in the constructor
        eager, compiled = DiffusionEngine(tiny_pipeline_dir), DiffusionEngine(tiny_pipeline_dir, compile_mode="blocks")
    with torch.no_grad():
        compiled.generate(request(PROMPTS[:2]))
    return eager, compiled


def test_compiled_blocks_keep_parameter_names_and_state_dict_keys(engines):
    eager, compiled = engines
    assert [n for n, _ in compiled.transformer.named_parameters()] == [
        n for n, _ in eager.transformer.named_parameters()
    ]
    assert list(compiled.transformer.state_dict()) == list(eager.transformer.state_dict())
    assert not any("_orig_mod" in key for key in compiled.transformer.state_dict())
    blocks = compiled.family.transformer_blocks(compiled.transformer)
    assert all(block._compiled_call_impl is not None for block in blocks)
    assert compiled.transformer._compiled_call_impl is None  # regional: the root stays eager


def test_compiled_engine_samples_what_the_eager_one_samples(engines):
    eager, compiled = engines
    for guidance in (1.0, 4.5):
        want, got = eager.generate(request(PROMPTS, guidance)), compiled.generate(request(PROMPTS, guidance))
        assert (got.final_latents - want.final_latents).abs().max().item() <= LATENT_TOLERANCE
        assert (got.log_probs - want.log_probs).abs().max().item() <= LOG_PROB_TOLERANCE


def test_no_recompile_across_batch_sizes_and_weight_loads(engines):
    eager, compiled = engines
    before = compile_counters()
    compiled.generate(request(PROMPTS[:3]))  # CFG: a batch of 6 where the warm-up had 4
    compiled.generate(request(PROMPTS[:2] * 2, guidance_scale=1.0))  # 4 rows, no CFG
    # new weights copied in place: the compiled code serves them, and they take effect
    weights = {k: v + 0.01 for k, v in eager.transformer.state_dict().items()}
    compiled.update_weights(weights, version=compiled.get_version() + 1)
    eager_moved = DiffusionEngine(compiled.family.path)
    eager_moved.update_weights(weights, version=0)
    got, want = compiled.generate(request(PROMPTS[:2])), eager_moved.generate(request(PROMPTS[:2]))
    assert compile_counters()["compile_recompiles"] == before["compile_recompiles"]
    assert compile_counters()["compile_s"] == before["compile_s"]
    assert got.compile_counters == compile_counters()
    assert (got.final_latents - want.final_latents).abs().max().item() <= LATENT_TOLERANCE
    assert (got.final_latents - eager.generate(request(PROMPTS[:2])).final_latents).abs().max().item() > 1e-3


def test_full_compiles_the_root_and_off_nothing(tiny_pipeline_dir):
    family = get_train_pipeline_config(tiny_pipeline_dir)
    full, off = family.load_transformer(), family.load_transformer()
    compile_transformer(full, family.transformer_blocks(full), "full")
    compile_transformer(off, family.transformer_blocks(off), "off")
    assert full._compiled_call_impl is not None
    assert off._compiled_call_impl is None
    assert all(block._compiled_call_impl is None for block in family.transformer_blocks(off))
    with pytest.raises(ValueError, match="--compile 'fast' is not one of off, blocks, full"):
        compile_transformer(off, [], "fast")


def test_a_family_that_declares_a_refusal_is_refused_naming_the_flag(tiny_pipeline_dir):
    family = get_train_pipeline_config(tiny_pipeline_dir)
    check_compile(family, "blocks")
    family.compile_refusal = "its blocks call a kernel dynamo cannot trace"
    with pytest.raises(ValueError, match=r"--compile blocks: the sd3 family cannot be compiled \(its blocks call"):
        check_compile(family, "blocks")
    check_compile(family, "off")


# one configuration of each family (the first in FAMILY_CASES), loading LoRA adapters or not
EACH_FAMILY = [case for i, case in enumerate(FAMILY_CASES) if case.family not in {c.family for c in FAMILY_CASES[:i]}]


# every family's blocks traced (17 min under a load of 10-20 on 2 cores, FLUX.1 197 s, LTX-2 past 300 s); the suite
# compiles SD3's above
@pytest.mark.standard
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("case", EACH_FAMILY, ids=[case.id for case in EACH_FAMILY])
def test_each_family_compiles_to_its_eager_velocity_or_refuses_at_start_up(request, case, monkeypatch):
    """`--compile blocks` on every family: its blocks compiled in place give the eager velocity (with and without
    its guidance, with source images where it takes them), or the family declares why not and the start-up check
    refuses it. The backend is $MILES_COMPILE_BACKEND if set (inductor: the performance.md table), else aot_eager."""
    path = request.getfixturevalue(case.fixture)
    family = get_train_pipeline_config(path, **case.family_options)
    if family.compile_refusal is not None:
        with pytest.raises(ValueError, match=f"--compile blocks: the {family.name} family cannot be compiled"):
            check_compile(family, "blocks")
        return
    check_compile(family, "blocks")
    sources = contract_source_images(case)
    prompts = CONTRACT_PROMPTS[: len(sources) if sources else 2]
    embeds, negative = family.encode_request(prompts, sources, "", negative=True)
    latents = torch.randn(
        len(prompts), *family.latent_shape(case.resolution), generator=torch.Generator().manual_seed(0)
    )
    sigmas = torch.full((len(prompts),), 0.7)
    transformer = family.load_transformer()

    def velocities():
        with torch.no_grad():
            return [
                family.predict_velocity(transformer, latents, sigmas, embeds, guidance_scale=w, negative=negative)
                for w in (1.0, 3.5)
            ]

    eager = velocities()
    monkeypatch.setenv(BACKEND_ENV, os.environ.get(BACKEND_ENV, "aot_eager"))
    compile_transformer(transformer, family.transformer_blocks(transformer), "blocks")
    compiled = velocities()
    assert all(block._compiled_call_impl is not None for block in family.transformer_blocks(transformer))
    for w, want, got in zip((1.0, 3.5), eager, compiled):
        assert (got - want).abs().max().item() <= LATENT_TOLERANCE * max(1.0, want.abs().max().item()), (case.id, w)
