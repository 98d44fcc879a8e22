"""--deterministic-mode's switch: what it turns on, and that a tiny SD3 training step runs under it on CPU."""

import os

import pytest
import torch

from miles.utils.distributed import use_deterministic_algorithms


@pytest.fixture
def restore_determinism(monkeypatch):
    for name in ("CUBLAS_WORKSPACE_CONFIG", "NCCL_ALGO"):
        monkeypatch.delenv(name, raising=False)
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark)
    before_cudnn = torch.backends.cudnn.deterministic
    yield
    torch.use_deterministic_algorithms(before[0])
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = before[1], before_cudnn


def test_deterministic_mode_switches_kernels_and_reductions(restore_determinism, tiny_pipeline_dir):
    from miles.models.base import get_train_pipeline_config

    use_deterministic_algorithms()
    assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
    assert not torch.backends.cudnn.benchmark
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and os.environ["NCCL_ALGO"] == "Ring"
    family = get_train_pipeline_config(tiny_pipeline_dir)
    model = family.load_transformer()
    embeds = family.encode_prompts(["a red circle"])
    x = torch.randn(1, *family.latent_shape(), generator=torch.Generator().manual_seed(0))
    grads = []
    for _ in range(2):
        model.zero_grad()
        family.predict_velocity(model, x, torch.tensor([0.5]), embeds).pow(2).mean().backward()
        grads.append(model.pos_embed.proj.weight.grad.clone())
    assert torch.equal(grads[0], grads[1])
