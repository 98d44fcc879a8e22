"""The rollout engine against independent computations: train-side log-prob recompute, a plain Euler loop,
diffusers' own pipeline, per-sample determinism, weight sync (full and LoRA), and Ray engine groups."""

import logging
import math

import numpy as np
import pytest
import ray
import torch

from miles.arguments.engine import EngineTimeouts, RolloutTimeout
from miles.diffusion.sde import get_sde_kernel
from miles.models.base import get_train_pipeline_config
from miles.ray.engine_group import RolloutEngineGroup
from miles.rollout.engine import DiffusionEngine
from miles.rollout.engine_api import GenerateRequest, GenerateResult, RolloutEngine
from miles.utils.failures import EngineError
from miles.utils.misc import split_contiguous as split_evenly
from miles.utils.weight_checksum import WeightSyncError, tensor_checksums

logger = logging.getLogger(__name__)
TIMEOUT = 120
TIMEOUTS = EngineTimeouts(startup_s=TIMEOUT, sync_s=TIMEOUT, rollout=RolloutTimeout(total_s=TIMEOUT))
PROMPTS = ["a red circle", "two blue squares on the left", "a green triangle", "three yellow circles"]
SEEDS = [11, 22, 33, 44]
LORA = dict(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0"], init_lora_weights=True)


def request(**overrides):
    values = dict(
        prompts=PROMPTS,
        seeds=SEEDS,
        num_steps=4,
        guidance_scale=4.5,
        negative_prompt="",
        sde_type="sde",
        noise_level=0.7,
        trained_steps=[0, 1, 2],
        decode=False,
    )
    values.update(overrides)
    return GenerateRequest(**values)


@pytest.fixture(scope="module")
def engine(tiny_pipeline_dir):
    return DiffusionEngine(tiny_pipeline_dir)


@pytest.fixture(scope="module")
def family(tiny_pipeline_dir):
    return get_train_pipeline_config(tiny_pipeline_dir)


@pytest.fixture(scope="module")
def fresh_transformer(family):
    return family.load_transformer().requires_grad_(False)


def initial_latents(family, seeds):
    return torch.stack([torch.randn(family.latent_shape(), generator=torch.Generator().manual_seed(s)) for s in seeds])


def test_engine_satisfies_the_interface(engine):
    assert isinstance(engine, RolloutEngine)
    assert engine.health() and engine.get_version() == -1


def test_result_shapes(engine, family):
    result = engine.generate(request(decode=True))
    c, h, w = family.latent_shape()
    assert result.images.shape == (4, family.default_resolution, family.default_resolution, 3)
    assert result.images.dtype == np.uint8
    assert result.final_latents.shape == (4, c, h, w)
    assert result.latents.shape == result.next_latents.shape == (4, 3, c, h, w)
    assert result.log_probs.shape == (4, 3) and torch.isfinite(result.log_probs).all()
    assert result.sigmas.shape == (5,) and result.sigmas[0] == 1 and result.sigmas[-1] == 0
    assert result.negative.batch_size == 1 and result.conditioning.batch_size == 4
    assert list(result.conditioning) == list(result.negative) == ["prompt_embeds", "pooled_prompt_embeds"]
    assert result.audio is None and result.fps is None  # an image family
    assert torch.equal(result.latents[:, 1:], result.next_latents[:, :-1])  # consecutive trained steps chain
    no_cfg = engine.generate(request(guidance_scale=1.0, prompts=PROMPTS[:1], seeds=SEEDS[:1], trained_steps=[]))
    assert no_cfg.negative is None and no_cfg.latents.shape == (1, 0, c, h, w)
    assert no_cfg.log_probs.shape == (1, 0)


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
@pytest.mark.parametrize("guidance_scale", [1.0, 4.5])
def test_recorded_log_probs_match_train_side_recompute(engine, family, fresh_transformer, sde_type, guidance_scale):
    result = engine.generate(request(sde_type=sde_type, guidance_scale=guidance_scale, trained_steps=[0, 2]))
    kernel = get_sde_kernel(sde_type)
    positive, negative = result.conditioning, result.negative
    batch = len(PROMPTS)
    for k, step in enumerate(result.trained_steps):
        sigma, sigma_next = result.sigmas[step].expand(batch), result.sigmas[step + 1].expand(batch)
        velocity = family.predict_velocity(
            fresh_transformer, result.latents[:, k], sigma, positive, guidance_scale=guidance_scale, negative=negative
        )
        recomputed = kernel(
            result.latents[:, k],
            velocity,
            sigma,
            sigma_next,
            noise_level=0.7,
            sigma_max=float(result.sigmas[1]),
            prev_sample=result.next_latents[:, k],
        ).log_prob
        diff = (recomputed - result.log_probs[:, k]).abs().max().item()
        logger.info("log-prob recompute |diff| %s cfg %s step %d: %.2e", sde_type, guidance_scale, step, diff)
        assert diff <= 1e-6


def test_recorded_means_are_the_train_side_kernel_means_and_only_on_request(engine, family, fresh_transformer):
    # the DanceGRPO kernel: GRPO-Guard / Flow-DPPO ask for the step means μ_old with record_means
    dance = dict(sde_type="dance", noise_level=0.3, guidance_scale=1.0, prompts=PROMPTS[:2], seeds=SEEDS[:2])
    asked = engine.generate(request(**dance, trained_steps=[0, 2], record_means=True))
    plain = engine.generate(request(**dance, trained_steps=[0, 2]))
    assert plain.means is None and torch.equal(plain.next_latents, asked.next_latents)
    assert asked.means.shape == asked.latents.shape
    batch = 2
    for k, step in enumerate(asked.trained_steps):
        sigma, sigma_next = asked.sigmas[step].expand(batch), asked.sigmas[step + 1].expand(batch)
        velocity = family.predict_velocity(fresh_transformer, asked.latents[:, k], sigma, asked.conditioning)
        out = get_sde_kernel("dance")(asked.latents[:, k], velocity, sigma, sigma_next, noise_level=0.3)
        assert (out.mean - asked.means[:, k]).abs().max().item() <= 1e-6
        # x' = μ + η·√(−dt)·z with the step's own noise: the record is the mean the sample was drawn around
        z = (asked.next_latents[:, k] - asked.means[:, k]) / out.step_std.reshape(-1, 1, 1, 1)
        assert 0.5 < z.std().item() < 1.5
    joined = GenerateResult.concat([asked, asked])
    assert torch.equal(joined.means, torch.cat([asked.means, asked.means]))


def test_sample_trajectory_does_not_depend_on_batch_mates(engine):
    alone = engine.generate(request(prompts=PROMPTS[2:3], seeds=SEEDS[2:3]))
    together = engine.generate(request())
    reordered = engine.generate(request(prompts=PROMPTS[::-1], seeds=SEEDS[::-1]))
    for other, row in ((together, 2), (reordered, 1)):
        for name in ("final_latents", "latents", "next_latents", "log_probs"):
            diff = (getattr(alone, name)[0] - getattr(other, name)[row]).abs().max().item()
            logger.info("batch-of-1 vs batch-of-4 max |diff| %s: %.2e", name, diff)
            assert diff <= 1e-5, name


def test_other_seed_other_trajectory(engine):
    result = engine.generate(request(prompts=PROMPTS[:1] * 2, seeds=[1, 2]))
    assert (result.final_latents[0] - result.final_latents[1]).abs().max() > 1e-2


def test_shared_initial_latent_leaves_only_the_sde_noise_to_differ(engine):
    """--diffusion-shared-initial-noise: the same start, each sample's own step noise; the group's first sample is
    exactly the one it would be without sharing."""
    shared = engine.generate(request(prompts=PROMPTS[:1] * 2, seeds=[1, 2], initial_seeds=[1, 1]))
    own = engine.generate(request(prompts=PROMPTS[:1], seeds=[1]))
    assert torch.equal(shared.latents[0, 0], shared.latents[1, 0])  # step 0's input: the initial latent
    assert (shared.next_latents[0, 0] - shared.next_latents[1, 0]).abs().max() > 1e-2
    assert (shared.final_latents[0] - own.final_latents[0]).abs().max() <= 1e-5
    ode = engine.generate(
        request(prompts=PROMPTS[:1] * 2, seeds=[1, 2], initial_seeds=[1, 1], sde_type="ode", trained_steps=[])
    )
    assert torch.equal(ode.final_latents[0], ode.final_latents[1])


def test_ode_without_recording_is_a_plain_euler_loop(engine, family, fresh_transformer):
    result = engine.generate(request(sde_type="ode", trained_steps=[]))
    positive, negative = result.conditioning, result.negative
    x = initial_latents(family, SEEDS)
    for i in range(4):
        s, s_next = result.sigmas[i], result.sigmas[i + 1]
        v = family.predict_velocity(fresh_transformer, x, s.expand(4), positive, guidance_scale=4.5, negative=negative)
        x = x + (s_next - s) * v
    assert (result.final_latents - x).abs().max().item() <= 1e-5


def test_ode_records_the_chosen_steps_inputs_and_euler_outputs_without_log_probs(engine):
    """What the reward-gradient losses train from: the inputs x_j of the recorded steps (the last included), their
    Euler outputs, NaN log-probs, and the same final latents as an unrecorded run."""
    plain = engine.generate(request(sde_type="ode", trained_steps=[]))
    recorded = engine.generate(request(sde_type="ode", trained_steps=[0, 3]))
    assert torch.equal(recorded.final_latents, plain.final_latents)
    assert torch.equal(recorded.next_latents[:, 1], recorded.final_latents)  # step 3 is the last: its output is x_N
    assert bool(recorded.log_probs.isnan().all()) and recorded.latents.shape[1] == 2


def test_ode_with_cfg_matches_the_diffusers_pipeline(engine, family, tiny_pipeline_dir):
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_pipeline_dir, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    kwargs = dict(prompt=PROMPTS, num_inference_steps=2, guidance_scale=4.5, max_sequence_length=32)
    start = initial_latents(family, SEEDS)
    expected = pipe(**kwargs, latents=start.clone(), output_type="latent").images
    result = engine.generate(request(num_steps=2, sde_type="ode", trained_steps=[], decode=True))
    latent_diff = (result.final_latents - expected).abs().max().item()
    logger.info("ode + CFG vs StableDiffusion3Pipeline: max |latent diff| %.2e", latent_diff)
    assert latent_diff <= 1e-5
    images = pipe(**kwargs, latents=start.clone(), output_type="np").images
    assert np.abs(result.images.astype(np.float64) - images * 255).max() <= 1.0


def test_full_update_ignores_stale_versions_and_is_strict(tiny_pipeline_dir, caplog):
    local = DiffusionEngine(tiny_pipeline_dir)
    req = request(prompts=PROMPTS[:2], seeds=SEEDS[:2])
    base = local.generate(req).final_latents
    original = {k: v.clone() for k, v in local.transformer.state_dict().items()}
    changed = {k: v * 1.1 if k == "proj_out.weight" else v.clone() for k, v in original.items()}
    local.update_weights(changed, version=3)
    after = local.generate(req)
    assert after.weights_version == 3 and local.get_version() == 3
    assert (after.final_latents - base).abs().max() > 1e-3
    with caplog.at_level(logging.WARNING, logger="miles.rollout.engine"):
        local.update_weights(original, version=3)  # not newer: ignored
    assert "ignoring weights version 3" in caplog.text
    assert torch.equal(local.generate(req).final_latents, after.final_latents)
    local.update_weights(original, version=4)
    assert torch.equal(local.generate(req).final_latents, base)
    with pytest.raises(RuntimeError, match="Missing key"):
        local.update_weights({k: v for k, v in original.items() if k != "proj_out.weight"}, version=5)


def lora_weights(engine, scale=0.05):
    gen = torch.Generator().manual_seed(0)
    named = {n: p for n, p in engine.transformer.named_parameters() if "lora_" in n}
    # PEFT's export names carry no adapter name; the engine maps them onto its own
    return {n.replace(".default.", "."): torch.randn(p.shape, generator=gen) * scale for n, p in named.items()}


def test_lora_update_equals_merged_full_weights(tiny_pipeline_dir, engine):
    lora_engine = DiffusionEngine(tiny_pipeline_dir, lora_config=LORA)
    req = request(prompts=PROMPTS[:2], seeds=SEEDS[:2])
    base = engine.generate(req).final_latents
    assert (lora_engine.generate(req).final_latents - base).abs().max() <= 1e-6  # B = 0 at init
    weights = lora_weights(lora_engine)
    lora_engine.update_weights(weights, version=1)
    with_lora = lora_engine.generate(req)
    assert with_lora.weights_version == 1 and (with_lora.final_latents - base).abs().max() > 1e-3

    merged = {k: v.clone() for k, v in DiffusionEngine(tiny_pipeline_dir).transformer.state_dict().items()}
    for key in [k for k in weights if ".lora_A." in k]:
        module = key.split(".lora_A.")[0]
        delta = weights[f"{module}.lora_B.weight"] @ weights[key]
        merged[f"{module}.weight"] += LORA["lora_alpha"] / LORA["r"] * delta
    full_engine = DiffusionEngine(tiny_pipeline_dir)
    full_engine.update_weights(merged, version=1)
    assert (full_engine.generate(req).final_latents - with_lora.final_latents).abs().max().item() <= 1e-5

    with pytest.raises(WeightSyncError, match="adapter has no weight for"):
        lora_engine.update_weights({**weights, "proj_out.weight": torch.zeros(1)}, version=2)
    with pytest.raises(WeightSyncError, match="missing"):
        lora_engine.update_weights(dict(list(weights.items())[1:]), version=2)
    assert lora_engine.get_version() == 1


def flip_one_bit(weights, name):
    """`weights` with the lowest bit of one element of `name` flipped: a corruption in transit."""
    out = {k: v.clone() for k, v in weights.items()}
    out[name].view(-1).view(torch.int16)[5] ^= 1
    return out


def test_a_sync_verified_against_the_trainers_checksums_names_a_corrupted_tensor(tiny_pipeline_dir):
    local = DiffusionEngine(tiny_pipeline_dir)
    sent = {k: v * 1.01 for k, v in local.transformer.state_dict().items()}
    local.update_weights(sent, version=1, checksums=tensor_checksums(sent))
    assert local.get_version() == 1
    with pytest.raises(WeightSyncError, match=r"version 2: 1 of \d+ tensors differ .* first 'proj_out.weight'"):
        local.update_weights(flip_one_bit(sent, "proj_out.weight"), version=2, checksums=tensor_checksums(sent))
    assert local.get_version() == 1


def test_a_bf16_lora_engine_verifies_the_fp32_adapter_it_casts(tiny_pipeline_dir):
    lora_engine = DiffusionEngine(tiny_pipeline_dir, forward_dtype=torch.bfloat16, lora_config=LORA)
    weights = lora_weights(lora_engine)  # fp32, as the trainer sends the adapter
    lora_engine.update_weights(weights, version=1, checksums=tensor_checksums(weights))
    name = sorted(weights)[3]
    with pytest.raises(WeightSyncError, match=f"first '{name}'"):
        lora_engine.update_weights(flip_one_bit(weights, name), version=2, checksums=tensor_checksums(weights))


def test_split_evenly():
    assert split_evenly(5, 2) == [(0, 3), (3, 5)]
    assert split_evenly(1, 3) == [(0, 1), (1, 1), (1, 1)]


def test_engine_group_matches_one_engine_syncs_weights_and_names_a_dead_engine(ray_cluster, tiny_pipeline_dir, engine):
    group = RolloutEngineGroup(tiny_pipeline_dir, num_engines=2, num_cpus_per_engine=0.5, timeouts=TIMEOUTS)
    try:
        # initial seeds (--diffusion-shared-initial-noise) travel with their prompts to each engine
        for size, initial_seeds in ((4, None), (3, None), (4, [SEEDS[0]] * 2 + [SEEDS[2]] * 2)):
            req = request(prompts=PROMPTS[:size], seeds=SEEDS[:size], initial_seeds=initial_seeds)
            split, single = group.generate(req, rollout_id=0), engine.generate(req)
            for name in ("final_latents", "latents", "next_latents", "log_probs"):
                diff = (getattr(split, name) - getattr(single, name)).abs().max().item()
                logger.info("2 engines vs 1, batch %d, max |diff| %s: %.2e", size, name, diff)
                assert diff <= 1e-5, name
            for name in single.conditioning:  # encoded per engine: thread counts differ at ~1e-8
                assert (split.conditioning[name] - single.conditioning[name]).abs().max() <= 1e-5, name
            if initial_seeds is not None:  # rows 2, 3 ran on engine 1 from row 2's start
                assert torch.equal(split.latents[2, 0], split.latents[3, 0])
        original = engine.transformer.state_dict()
        changed = {k: v * 1.1 if k == "proj_out.weight" else v for k, v in original.items()}
        group.update_weights(changed, version=1)
        group.update_weights(original, version=0)  # stale: ignored by every engine
        assert group.get_versions() == [1, 1]
        result = group.generate(request(prompts=PROMPTS[:2], seeds=SEEDS[:2]))
        assert result.weights_version == 1
        assert (
            result.final_latents - engine.generate(request(prompts=PROMPTS[:2], seeds=SEEDS[:2])).final_latents
        ).abs().max() > 1e-3

        checked = {k: v * 1.01 for k, v in original.items()}
        group.update_weights(checked, version=2, checksums=tensor_checksums(checked))
        with pytest.raises(
            WeightSyncError, match=r"rollout engine 0 of 2, weight sync \(version 3\) of rollout 4: .*'pos_embed.proj"
        ):
            corrupted = flip_one_bit(checked, "pos_embed.proj.weight")
            group.update_weights(corrupted, version=3, rollout_id=4, checksums=tensor_checksums(checked))

        ray.kill(group.engines[1])
        assert group.health() == [True, False]
        with pytest.raises(EngineError, match="rollout engine 1 of 2 died during generate of rollout 5"):
            group.generate(request(), rollout_id=5)
        with pytest.raises(EngineError, match=r"engine 1 of 2 died during weight sync \(version 4\) of rollout 6"):
            group.update_weights(original, version=4, rollout_id=6)
        with pytest.raises(EngineError, match="rollout engine 1 of 2 died during sleep of rollout 7"):
            group.sleep(rollout_id=7)
        with pytest.raises(EngineError, match="rollout engine 1 of 2 died during wake of rollout 7"):
            group.wake(rollout_id=7)
    finally:
        group.shutdown()


def allocated(engine: DiffusionEngine) -> DiffusionEngine:
    """The engine with its weights in allocated memory, as on a GPU: on CPU they are memory-mapped from the
    safetensors files, which a sleep leaves in place (and a copy changes the text encoders' bits at 1e-7: the
    kernels follow the alignment)."""
    with torch.no_grad():
        for module in [engine.transformer, *engine.family.loaded_modules()]:
            for param in module.parameters():
                param.data = param.data.clone()
            for sub in module.modules():
                sub._buffers.update({name: b.clone() for name, b in sub._buffers.items() if b is not None})
    engine.family.drop_cached_negatives()
    return engine


def test_sleep_and_wake_keep_the_samples_bit_for_bit_and_dropped_weights_must_be_reloaded(tiny_pipeline_dir):
    """--colocate-sleep: a sleeping engine holds no network memory on its device; it samples exactly as before once
    awake, and after a sleep that dropped its trained weights it refuses to sample until a sync loads them."""
    local = allocated(DiffusionEngine(tiny_pipeline_dir))
    req = request(prompts=PROMPTS[:2], seeds=SEEDS[:2], sde_type="ode", trained_steps=[], decode=True)
    base = local.generate(req)
    weights = {k: v.clone() for k, v in local.transformer.state_dict().items()}
    networks = [local.transformer, *local.family.loaded_modules()]
    assert len(networks) >= 3  # transformer, the text pipeline's encoders, the VAE

    report = local.sleep()
    assert report["copied_bytes"] > 0 and report["discarded_bytes"] == report["kept_bytes"] == 0
    assert all(t.untyped_storage().nbytes() == 0 for m in networks for t in (*m.parameters(), *m.buffers()))
    again = local.generate(req)  # wakes itself
    assert torch.equal(again.final_latents, base.final_latents) and np.array_equal(again.images, base.images)

    report = local.sleep(discard_weights=True)
    trained = sum(v.untyped_storage().nbytes() for v in weights.values())
    assert report["discarded_bytes"] == trained
    with pytest.raises(RuntimeError, match="released its trained weights.*call update_weights first"):
        local.generate(req)
    local.update_weights(weights, version=1)
    assert torch.equal(local.generate(req).final_latents, base.final_latents)


def test_a_lora_engine_drops_only_its_adapter_when_it_sleeps(tiny_pipeline_dir):
    lora_engine = allocated(DiffusionEngine(tiny_pipeline_dir, lora_config=LORA))
    weights = lora_weights(lora_engine)
    lora_engine.update_weights(weights, version=1)
    req = request(prompts=PROMPTS[:2], seeds=SEEDS[:2])
    before = lora_engine.generate(req).final_latents
    report = lora_engine.sleep(discard_weights=True)
    assert report["discarded_bytes"] == sum(v.nbytes for v in weights.values()) and report["copied_bytes"] > 0
    lora_engine.update_weights(weights, version=2)
    assert torch.equal(lora_engine.generate(req).final_latents, before)


def test_an_engine_actor_on_cpu_keeps_its_heap_before_loading(tiny_pipeline_dir, monkeypatch):
    """The Ray engine class turns the garbage collector back on (its imports are done: `miles.utils.import_gc`) and
    raises the heap thresholds (`miles.utils.heap`) before its pipeline loads; the plain
    `DiffusionEngine` (in-process use: benchmarks, tests) leaves the process alone."""
    import miles.ray.engine_group as engine_group
    import miles.rollout.engine as engine_module

    events = []
    monkeypatch.setattr(engine_group.import_gc, "resume", lambda: events.append("gc"))  # miles.utils.import_gc
    monkeypatch.setattr(engine_group, "keep_freed_memory", lambda: events.append("heap") or True)
    load = engine_module.get_train_pipeline_config
    monkeypatch.setattr(
        engine_module, "get_train_pipeline_config", lambda *a, **k: events.append("load") or load(*a, **k)
    )
    engine_group.EngineActor(tiny_pipeline_dir, device="cpu")
    assert events == ["gc", "heap", "load"]
    DiffusionEngine(tiny_pipeline_dir)
    assert events == ["gc", "heap", "load", "load"]


def test_flash_on_flux_compresses_fluxs_own_resolution_shifted_schedule(tiny_flux_dev_dir):
    """FluxPipeline's grid is σ = e^μ·t/(1 + (e^μ − 1)·t) at t = linspace(1, 1/N, N) (diffusers' exponential time
    shift; μ from the resolution), then 0: the Flash grid after the window takes the same map of a coarser uniform t,
    so where the spacings divide it is a subset of the grid itself, and at ratio 1 it is the grid."""
    from miles.diffusion.dpm_solver import flash_sigmas

    flux = DiffusionEngine(tiny_flux_dev_dir)
    resolution, steps = 32, 25
    mu = flux.family.mu(resolution)
    t = torch.linspace(1.0, 1.0 / steps, steps, dtype=torch.float64)
    by_hand = math.exp(mu) * t / (1 + (math.exp(mu) - 1) * t)
    grid = flux.family.sampling_sigmas(steps, resolution)
    torch.testing.assert_close(grid[:-1].double(), by_hand, atol=1e-6, rtol=0)  # the ground truth is diffusers'
    assert abs(math.exp(mu) - 1) > 0.3 and flux.family.sampling_shift(resolution) == pytest.approx(math.exp(mu))
    # window 0-3 (L = 3), ratio 0.4: max(int(22·0.4), 2) = 8 post points, t from 21/25 in steps of 3/25
    subset = grid[[0, 1, 2, 3, 4, 7, 10, 13, 16, 19, 22, 25]]
    assert not torch.allclose(flash_sigmas(grid, 3, 0.4, 1.0), subset, atol=1e-3)  # the linear post grid was not
    short = dict(prompts=PROMPTS[:1], seeds=SEEDS[:1], num_steps=steps, guidance_scale=1.0, resolution=resolution)
    flash = flux.generate(request(**short, trained_steps=[0, 1, 2, 3], flash_ratio=0.4))
    torch.testing.assert_close(flash.sigmas, subset, atol=1e-6, rtol=0)
    whole = flux.generate(request(**short, trained_steps=[0, 1, 2, 3], flash_ratio=1.0))
    torch.testing.assert_close(whole.sigmas, grid, atol=1e-6, rtol=0)


def test_flash_keeps_the_window_bit_for_bit_and_runs_dpm_solver_after_it(engine, family, fresh_transformer):
    two = dict(prompts=PROMPTS[:2], seeds=SEEDS[:2], num_steps=8, guidance_scale=1.0, trained_steps=[1, 2])
    plain, flash = engine.generate(request(**two)), engine.generate(request(**two, flash_ratio=0.5))
    for name in ("latents", "next_latents", "log_probs"):
        assert torch.equal(getattr(flash, name), getattr(plain, name))  # the window precedes the Flash part
    grid = flash.sigmas.double()
    assert len(grid) == 3 + 3 and torch.equal(grid[:4], plain.sigmas[:4].double())  # max(int((8 − 2)·0.5), 2) = 3
    assert (grid[3:].diff() < 0).all() and grid[-1] == 0.0

    def denoised(x, i):
        v = family.predict_velocity(fresh_transformer, x, flash.sigmas[i].expand(2), flash.conditioning)
        return x.double() - grid[i] * v.double()

    # DPM-Solver++(2M), x₀ form, written out: λ = log((1 − σ)/σ), x' = (σ'/σ)x − α'(e^{−h} − 1)(D0 + D1/2)
    lam = torch.log((1 - grid[:-1]) / grid[:-1])
    previous, x = denoised(flash.latents[:, -1], 2), flash.next_latents[:, -1].double()
    for i in (3, 4):
        d0 = denoised(x.float(), i)
        if grid[i + 1] == 0:
            x = d0  # the last step is first order: x̂₀
        else:
            h = lam[i + 1] - lam[i]
            d1 = (d0 - previous) / ((lam[i] - lam[i - 1]) / h)
            x = grid[i + 1] / grid[i] * x - (1 - grid[i + 1]) * (torch.exp(-h) - 1) * (d0 + d1 / 2)
        previous = d0
    assert (flash.final_latents.double() - x).abs().max().item() <= 1e-5
