"""The planner's networks and tokenizers from a pipeline folder's configs alone
(miles/models/loading/configs_only.py), on the tiny FLUX.1-dev folder: every prompt tokenized at its longest by a
stand-in of the folder's tokenizer class, networks of the real shapes in the asked dtype (fp32 where the class keeps
it), eval mode without gradients, and schedulers left to the pipeline's loader."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import AutoencoderKL, FluxTransformer2DModel
from transformers import CLIPTokenizer, T5Tokenizer

from miles.models.loading.configs_only import (
    DEFAULT_TOKENS,
    PlanTokenizer,
    keep_fp32_parameters,
    pipeline_components_from_configs,
    tokenizer_from_config,
)


def test_the_stand_in_tokenizer_is_the_folders_class_and_gives_every_prompt_its_longest(tiny_flux_dev_dir, tmp_path):
    tokenizer = tokenizer_from_config(Path(tiny_flux_dev_dir) / "tokenizer", "CLIPTokenizer")
    assert isinstance(tokenizer, CLIPTokenizer) and isinstance(tokenizer, PlanTokenizer)
    assert tokenizer.model_max_length == 77  # the folder's
    batch = tokenizer(["a", "a much longer prompt"])
    assert batch["input_ids"].shape == (2, 77) and bool(batch["attention_mask"].all())
    assert tokenizer("a", max_length=9)["input_ids"].shape == (1, 9)
    assert tokenizer.apply_chat_template([[{"role": "user"}]], tokenize=True, max_length=5)["input_ids"].shape == (1, 5)
    assert tokenizer.apply_chat_template("text") == "text" and tokenizer.batch_decode([[1], [2]]) == ["", ""]
    bare = tokenizer_from_config(tmp_path, "NoSuchTokenizer")  # no folder, an unknown class: the defaults
    assert bare.model_max_length == DEFAULT_TOKENS and not isinstance(bare, CLIPTokenizer)


def test_networks_are_built_from_configs_at_their_shapes_in_the_asked_dtype(tiny_flux_dev_dir):
    names = {"transformer", "vae", "tokenizer_2", "scheduler", "feature_extractor"}
    built = pipeline_components_from_configs(tiny_flux_dev_dir, names, torch.bfloat16)
    assert set(built) == {"transformer", "vae", "tokenizer_2"}  # the scheduler: the pipeline's own loader; None left
    assert isinstance(built["tokenizer_2"], T5Tokenizer)
    transformer, vae = built["transformer"], built["vae"]
    assert isinstance(transformer, FluxTransformer2DModel) and isinstance(vae, AutoencoderKL)
    real = FluxTransformer2DModel.from_pretrained(tiny_flux_dev_dir, subfolder="transformer")
    assert {k: v.shape for k, v in transformer.state_dict().items()} == {
        k: v.shape for k, v in real.state_dict().items()
    }
    assert {p.dtype for p in transformer.parameters()} == {torch.bfloat16}
    assert not transformer.training and not any(p.requires_grad for p in transformer.parameters())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_classes_fp32_modules_stay_fp32(dtype):
    class Keeps(torch.nn.Module):
        _keep_in_fp32_modules = ["norm"]

        def __init__(self):
            super().__init__()
            self.proj, self.norm = torch.nn.Linear(2, 2), torch.nn.LayerNorm(2)

    module = Keeps()
    keep_fp32_parameters(module, Keeps, dtype)
    assert module.proj.weight.dtype == dtype and module.norm.weight.dtype == torch.float32
