"""The trunk on CUDA: NCCL process group, FSDP2 with bf16 forward, fp32 log-prob maths, engine parity."""

import pytest
import torch

from miles.arguments.parser import parse_args
from miles.utils.box import put_box

pytestmark = pytest.mark.gpu


def gpu_args(pipeline_dir, *extra):
    return parse_args(
        [
            "--hf-checkpoint",
            pipeline_dir,
            "--prompt-data",
            "builtin:shapes",
            "--loss-type",
            "sft_loss",
            "--train-only",
            "--device",
            "cuda",
            "--dp-size",
            "1",
            "--rollout-batch-size",
            "8",
            "--global-batch-size",
            "4",
            "--num-steps-per-rollout",
            "2",
            "--micro-batch-size",
            "2",
            "--log-level",
            "WARNING",
            *extra,
        ]
    )


def test_sde_log_prob_is_fp32_under_bf16_inputs_on_cuda():
    from miles.diffusion.sde import sde_step

    x = torch.randn(2, 4, 8, 8, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(x)
    out = sde_step(x, v, 0.8, 0.6, noise_level=0.7, sigma_max=0.96, generator=None)
    assert out.log_prob.dtype == torch.float32 and out.next_latents.dtype == torch.float32


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_fsdp2_group_trains_on_cuda_with_nccl(ray_cluster, tiny_pipeline_dir, dtype):
    from miles.models.base import get_train_pipeline_config
    from miles.ray.train_group import RayTrainGroup
    from tests.fast.ray.test_train_group import make_pairs

    family = get_train_pipeline_config(tiny_pipeline_dir)
    family.load_text_encoders()
    args = gpu_args(tiny_pipeline_dir, "--diffusion-forward-dtype", dtype)
    group = RayTrainGroup(args, "actor", timeout=300)
    try:
        group.init()
        group.train(0, [put_box(make_pairs(family, 8))])
        metrics = group.pop_metrics()
    finally:
        group.shutdown()
    assert len(metrics) == 2 and all(torch.isfinite(torch.tensor(m["train/loss"])) for m in metrics)


def test_engine_log_probs_match_trainer_recompute_on_cuda(tiny_pipeline_dir):
    from miles.diffusion.sde import sde_step
    from miles.rollout.engine import DiffusionEngine
    from miles.rollout.engine_api import GenerateRequest

    engine = DiffusionEngine(tiny_pipeline_dir, device="cuda")
    result = engine.generate(
        GenerateRequest(
            prompts=["a red circle on the left"] * 2,
            seeds=[1, 2],
            num_steps=4,
            guidance_scale=1.0,
            negative_prompt="",
            sde_type="sde",
            noise_level=0.7,
            trained_steps=[0, 1, 2],
        )
    )
    family, transformer = engine.family, engine.transformer
    embeds = result.conditioning.to(device="cuda")
    for k, step in enumerate(result.trained_steps):
        x = result.latents[:, k].cuda()
        sigma = result.sigmas[step].expand(2).cuda()
        v = family.predict_velocity(transformer, x, sigma, embeds)
        out = sde_step(
            x,
            v,
            sigma,
            result.sigmas[step + 1].expand(2).cuda(),
            noise_level=0.7,
            sigma_max=float(result.sigmas[1]),
            prev_sample=result.next_latents[:, k].cuda(),
        )
        assert (out.log_prob.cpu() - result.log_probs[:, k]).abs().max() <= 1e-5
