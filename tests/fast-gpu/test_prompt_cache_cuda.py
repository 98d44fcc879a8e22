"""The prompt cache on CUDA: a family declared exact (`prompt_cache_exact`, checked on CPU by the family contract)
encodes a prompt alone as in a batch on the GPU too, in bf16, so a cached engine samples bit for bit as an uncached one;
the key names the GPU and its TF32 switches; freeing the text encoders gives their device memory back."""

import pytest
import torch

from miles.models.base import get_train_pipeline_config
from miles.models.conditioning import Conditioning
from miles.rollout.engine import DiffusionEngine
from miles.rollout.engine_api import GenerateRequest
from miles.rollout.prompt_cache import PromptCacheConfig, device_signature, encoder_fingerprint

pytestmark = pytest.mark.gpu
PROMPTS = ["a red circle", "two blue squares on the left of a big triangle", "a", "a red circle"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_exact_family_encodes_alone_as_in_a_batch_on_cuda(tiny_flux_dev_dir, dtype):
    family = get_train_pipeline_config(tiny_flux_dev_dir)
    family.load_text_encoders(device="cuda", dtype=dtype)
    batch = family.encode_prompts(PROMPTS, device="cuda")
    alone = Conditioning.cat([family.encode_prompts([p], device="cuda") for p in PROMPTS])
    assert all(torch.equal(alone[name], batch[name]) for name in batch)
    assert torch.cuda.get_device_name() in device_signature(torch.device("cuda"))


def test_a_cached_bf16_engine_on_cuda_samples_as_an_uncached_one_and_frees_its_encoders(tiny_flux_dev_dir, tmp_path):
    request = GenerateRequest(
        prompts=PROMPTS,
        seeds=[1, 2, 3, 4],
        num_steps=3,
        guidance_scale=3.5,
        negative_prompt="",
        sde_type="sde",
        noise_level=0.7,
        trained_steps=[0, 1],
        decode=False,
        return_negative=True,
    )
    kwargs = dict(device="cuda", forward_dtype=torch.bfloat16)
    plain = DiffusionEngine(tiny_flux_dev_dir, **kwargs)
    expected = plain.generate(request)
    del plain
    cache = PromptCacheConfig(
        str(tmp_path), encoder_fingerprint(get_train_pipeline_config(tiny_flux_dev_dir), torch.bfloat16)
    )
    engine = DiffusionEngine(tiny_flux_dev_dir, prompt_cache=cache, **kwargs)
    torch.cuda.synchronize()
    before_fill = torch.cuda.memory_allocated()
    engine.fill_prompt_cache(PROMPTS, [""])
    assert engine.release_text_encoders()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= before_fill  # the encoders loaded for the fill are gone again
    result = engine.generate(request)
    for name in ("final_latents", "latents", "log_probs"):
        assert torch.equal(getattr(result, name), getattr(expected, name)), name
    assert not engine.prompt_encoder.loaded
