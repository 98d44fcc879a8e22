"""A rollout engine on CUDA: its transformer loads straight onto the device (no host copy, device memory within 1.2x
the weights while loading, the same tensors as from_pretrained), and micro-batches give the samples of one batch up to
bf16 rounding (cuBLAS picks its kernels by shape, so not bit for bit)."""

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_the_transformer_loads_onto_the_gpu_within_1_2x_its_weights(tiny_pipeline_dir):
    from miles.models.base import get_train_pipeline_config
    from miles.models.loading.checkpoint_files import load_transformer_direct

    family = get_train_pipeline_config(tiny_pipeline_dir)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model = load_transformer_direct(family, dtype=torch.bfloat16, device="cuda")
    held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    assert torch.cuda.max_memory_allocated() - before <= 1.2 * held
    assert all(t.is_cuda for t in model.state_dict().values())
    reference = family.load_transformer(dtype=torch.bfloat16)
    for name, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name].cpu(), value), name


def test_micro_batches_on_cuda_agree_with_one_batch(tiny_pipeline_dir):
    from miles.rollout.engine import DiffusionEngine
    from miles.rollout.engine_api import GenerateRequest

    engine = DiffusionEngine(tiny_pipeline_dir, device="cuda", forward_dtype=torch.bfloat16)
    req = GenerateRequest(
        prompts=[f"{n} red circles" for n in range(6)],
        seeds=list(range(6)),
        num_steps=3,
        guidance_scale=4.5,
        negative_prompt="",
        sde_type="sde",
        noise_level=0.7,
        trained_steps=[0, 1],
        decode=False,
    )
    whole = engine.generate(req)
    engine.micro_batch_size = 2
    parts = engine.generate(req)
    assert engine.progress().micro_batches == 3
    assert (parts.final_latents - whole.final_latents).abs().max() <= 0.05
    assert (parts.log_probs - whole.log_probs).abs().max() <= 0.05
