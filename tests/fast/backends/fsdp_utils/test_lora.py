"""LoRA on the tiny SD3 transformer under FSDP2 (gloo, world size 1): only adapters train, the engine and a saved
adapter folder reproduce the trained outputs, and the adapter-free forward equals the base model loaded anew."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
from diffusers import StableDiffusion3Pipeline
from peft import LoraConfig

from miles.arguments.parser import default_args
from miles.backends.fsdp_utils.fsdp import apply_fsdp2
from miles.backends.fsdp_utils.gather import full_state_dict
from miles.backends.fsdp_utils.lora import (
    LoraBaseNetwork,
    adapters_disabled,
    apply_lora,
    load_lora_state_dict,
    lora_config_from_args,
    lora_state_dict,
    save_lora_adapter,
)
from miles.models.base import get_train_pipeline_config
from miles.models.conditioning import Conditioning
from miles.utils.distributed import destroy_process_group, find_free_port, init_process_group

STEPS = 2
CONFIG_ARGS = default_args(lora_rank=4, lora_alpha=8, lora_init_weights="true")  # alpha != rank: scale 2


def _is_lora(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


@pytest.fixture(scope="module")
def family(tiny_pipeline_dir):
    return get_train_pipeline_config(tiny_pipeline_dir)


@pytest.fixture(scope="module")
def inputs() -> dict:
    gen = torch.Generator().manual_seed(0)
    embeds = Conditioning(
        {
            "prompt_embeds": torch.randn(2, 77 + 32, 64, generator=gen),
            "pooled_prompt_embeds": torch.randn(2, 64, generator=gen),
        }
    )
    return {
        "latents": torch.randn(2, 4, 8, 8, generator=gen),
        "sigmas": torch.tensor([0.7, 0.3]),
        "embeds": embeds,
        "target": torch.randn(2, 4, 8, 8, generator=gen),
    }


def _velocity(family, network: torch.nn.Module, inputs: dict) -> torch.Tensor:
    return family.predict_velocity(network, inputs["latents"], inputs["sigmas"], inputs["embeds"])


@pytest.fixture(scope="module")
def gloo_world_of_one():
    init_process_group(0, 1, "127.0.0.1", find_free_port(), "cpu", timeout=timedelta(seconds=60))
    yield
    destroy_process_group()


def _train(family, inputs: dict, *, ref_forward: bool) -> dict:
    """LoRA, then FSDP2, then AdamW steps; with `ref_forward` an adapter-free forward runs before each backward."""
    config = lora_config_from_args(CONFIG_ARGS, "sd3")
    torch.manual_seed(0)  # lora_A's random init
    model = apply_lora(family.load_transformer(), config)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    lora_dtypes = {p.dtype for n, p in model.named_parameters() if _is_lora(n)}
    apply_fsdp2(model, family.transformer_blocks(model), param_dtype=torch.float32, reduce_dtype=torch.float32)
    before = {k: v.clone() for k, v in full_state_dict(model).items()}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = ((_velocity(family, model, inputs) - inputs["target"]) ** 2).mean()
        if ref_forward:
            with torch.no_grad():
                _velocity(family, LoraBaseNetwork(model), inputs)
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        out = _velocity(family, model, inputs)
        with adapters_disabled(model):
            out_disabled = _velocity(family, model, inputs)
        out_base_network = _velocity(family, LoraBaseNetwork(model), inputs)
        out_after = _velocity(family, model, inputs)
    return {
        "config": config,
        "model": model,
        "trainable": trainable,
        "lora_dtypes": lora_dtypes,
        "before": before,
        "after": full_state_dict(model),
        "out": out,
        "out_disabled": out_disabled,
        "out_base_network": out_base_network,
        "out_after": out_after,
    }


@pytest.fixture(scope="module")
def trained(gloo_world_of_one, family, inputs) -> dict:
    return _train(family, inputs, ref_forward=True)


@pytest.fixture(scope="module")
def base_out(family, inputs) -> torch.Tensor:
    with torch.no_grad():
        return _velocity(family, family.load_transformer(), inputs)


def test_default_targets_are_linear_modules_of_the_sd3_transformer(family):
    names = {name: type(m).__name__ for name, m in family.load_transformer().named_modules()}
    assert family.default_lora_targets  # the family names them; lora.py holds none of its own
    for target in family.default_lora_targets:
        matches = [kind for name, kind in names.items() if name.endswith("." + target)]
        assert matches and set(matches) == {"Linear"}, target


def test_lora_config_from_args(family):
    config = lora_config_from_args(default_args(), "sd3")
    assert config == {
        "r": 8,
        "lora_alpha": 8.0,
        "target_modules": list(family.default_lora_targets),
        "init_lora_weights": True,
        "lora_dropout": 0.0,
    }
    config = lora_config_from_args(
        default_args(lora_rank=4, lora_alpha=16, lora_target_modules="to_q, to_k", lora_init_weights="FALSE"), "x"
    )
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (4, 16.0, ["to_q", "to_k"])
    assert config["init_lora_weights"] is False
    assert lora_config_from_args(default_args(lora_init_weights="gaussian"), "sd3")["init_lora_weights"] == "gaussian"
    LoraConfig(**config)
    with pytest.raises(ValueError, match="--lora-init-weights"):
        lora_config_from_args(default_args(lora_init_weights="pissa"), "sd3")
    with pytest.raises(ValueError, match="'cogvideox' is not a registered model family.*--lora-target-modules"):
        lora_config_from_args(default_args(), "cogvideox")


def test_only_lora_parameters_train_under_fsdp2(trained):
    assert trained["trainable"] == {k for k in trained["before"] if _is_lora(k)}
    assert trained["lora_dtypes"] == {torch.float32}
    assert len(trained["trainable"]) > 0
    unchanged_lora_b = set()
    for name, before in trained["before"].items():
        after = trained["after"][name]
        if not _is_lora(name):
            assert torch.equal(after, before), f"base weight {name} changed"
        elif ".lora_B." in name and torch.equal(after, before):
            unchanged_lora_b.add(name)
    # The last block is context_pre_only: its context query feeds only the dropped context output (no gradient).
    assert unchanged_lora_b == {"transformer_blocks.1.attn.add_q_proj.lora_B.default.weight"}


def test_ref_forward_leaves_training_unchanged(trained, family, inputs):
    plain = _train(family, inputs, ref_forward=False)
    for name, value in plain["after"].items():
        assert torch.equal(trained["after"][name], value), name


def test_engine_loads_lora_weights_and_matches_trained_outputs(trained, family, inputs):
    lora = lora_state_dict(trained["after"])
    assert set(lora) == trained["trainable"]
    engine = family.load_transformer()
    engine.add_adapter(LoraConfig(**trained["config"]))
    load_lora_state_dict(engine, lora)
    with torch.no_grad():
        out = _velocity(family, engine, inputs)
    torch.testing.assert_close(out, trained["out"], atol=1e-6, rtol=0)
    with pytest.raises(KeyError, match="missing"):
        load_lora_state_dict(engine, dict(list(lora.items())[1:]))


def test_adapters_disabled_equals_the_base_model(trained, base_out):
    assert (trained["out"] - base_out).abs().max() > 1e-3  # the adapter does change the output
    torch.testing.assert_close(trained["out_disabled"], base_out, atol=1e-6, rtol=0)
    torch.testing.assert_close(trained["out_base_network"], base_out, atol=1e-6, rtol=0)
    assert torch.equal(trained["out_after"], trained["out"])  # adapters are back on after the block
    assert {n for n, p in trained["model"].named_parameters() if p.requires_grad} == trained["trainable"]


def test_saved_adapter_loads_into_sd3_pipeline(trained, family, inputs, base_out, tiny_pipeline_dir, tmp_path):
    save_lora_adapter(lora_state_dict(trained["after"]), trained["config"], tmp_path / "lora")
    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_pipeline_dir, local_files_only=True)
    pipe.load_lora_weights(str(tmp_path / "lora"))
    with torch.no_grad():
        out = _velocity(family, pipe.transformer, inputs)
    torch.testing.assert_close(out, trained["out"], atol=1e-6, rtol=0)


def test_apply_lora_after_fsdp2_is_rejected(trained):
    with pytest.raises(RuntimeError, match="before apply_fsdp2"):
        apply_lora(trained["model"], trained["config"])


def test_lora_targets_that_match_no_module_fail_before_the_adapter_is_injected(family):
    # peft alone binds to_q and skips to_qkv without a word; the trainer refuses at start-up, naming it
    model = family.load_transformer()
    config = {"r": 4, "lora_alpha": 4.0, "target_modules": ["to_q", "to_qkv"], "init_lora_weights": True}
    with pytest.raises(ValueError, match=r"--lora-target-modules \['to_qkv'\] match no module of the trained"):
        apply_lora(model, config)
    assert not any("lora_" in name for name, _ in model.named_parameters())
