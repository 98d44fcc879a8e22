"""The rollout engine's LoRA adapter (miles/rollout/engine_lora.py) on the tiny SD3 transformer: injected where the
targets name modules, the names the trainer sends mapped to its parameters (the engine's own, PEFT's adapter-less
export names, diffusers' `transformer.`-prefixed file keys), every weight required and nothing else accepted; targets that match no module refused when the engine starts."""

from __future__ import annotations

import pytest
import torch

from miles.models.base import get_train_pipeline_config
from miles.rollout.engine import DiffusionEngine
from miles.rollout.engine_lora import EngineLora
from miles.utils.weight_checksum import WeightSyncError
from miles.weight_sync.protocol import plan_buckets

LORA = dict(r=2, lora_alpha=4, target_modules=["to_q", "to_v"], init_lora_weights=True)


@pytest.fixture(scope="module")
def lora(tiny_pipeline_dir):
    adapter = EngineLora(get_train_pipeline_config(tiny_pipeline_dir).load_transformer(), LORA)
    adapter.transformer.requires_grad_(False)  # as the engine holds it
    return adapter


def exported(lora: EngineLora, value: float = 0.5, prefix: str = "") -> dict[str, torch.Tensor]:
    """The adapter as PEFT exports it (no `.default.`), each tensor filled with `value`."""
    params = dict(lora.transformer.named_parameters())
    return {prefix + n.replace(".default.", "."): torch.full_like(params[n], value) for n in set(lora.names.values())}


def test_the_adapter_is_injected_on_the_targets_only_and_knows_both_spellings(lora):
    own = sorted(set(lora.names.values()))
    assert own and all(".default." in n and (".to_q." in n or ".to_v." in n) for n in own)
    assert {n for n in lora.names if ".default." not in n} == {n.replace(".default.", ".") for n in own}
    assert EngineLora.key("transformer.a.lora_A.weight") == "a.lora_A.weight" and EngineLora.key("a") == "a"


def test_load_copies_every_weight_in_the_parameters_dtype_whatever_the_keys_spelling(lora):
    weights = {k: v.double() for k, v in exported(lora, 0.25, prefix="transformer.").items()}
    written = lora.load(weights)
    assert set(written) == set(weights)
    for key, param in written.items():
        assert param.dtype == torch.float32 and torch.equal(param, torch.full_like(param, 0.25)), key


def test_load_refuses_an_unknown_tensor_and_a_missing_weight(lora):
    weights = exported(lora)
    with pytest.raises(WeightSyncError, match=r"got 1 adapter tensors this engine's adapter has no weight for, e.g. "):
        lora.load({**weights, "proj_out.weight": torch.zeros(1)})
    first = sorted(weights)[0]
    with pytest.raises(WeightSyncError, match=r"update_weights is missing 1 LoRA weights"):
        lora.load({k: v for k, v in weights.items() if k != first})


def test_a_sync_plan_must_carry_every_lora_weight(lora):
    entries = [(k, tuple(v.shape), v.dtype) for k, v in exported(lora).items()]
    targets = lora.sync_targets(plan_buckets(entries, 1 << 20))
    params = dict(lora.transformer.named_parameters())
    assert {k: id(t) for k, t in targets.items()} == {k: id(params[lora.names[k]]) for k, _, _ in entries}
    with pytest.raises(WeightSyncError, match=r"the weight sync is missing 1 LoRA weights"):
        lora.sync_targets(plan_buckets(entries[1:], 1 << 20))


def test_an_adapter_whose_target_modules_do_not_exist_fails_at_start_naming_them(tiny_pipeline_dir):
    # peft alone binds to_q and skips the others without a word (it fails only when no target exists)
    config = {**LORA, "target_modules": ["to_q", "to_qkv", "ff.proj"]}
    with pytest.raises(ValueError, match=r"--lora-target-modules \['to_qkv', 'ff.proj'\] match no module of the "):
        DiffusionEngine(tiny_pipeline_dir, lora_config=config)
