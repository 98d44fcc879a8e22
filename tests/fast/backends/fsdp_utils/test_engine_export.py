"""What the engines sample with, as a trainer rank exports it: which weights (the declared shadow the loss-hub entry
names, EMA weights under --ema-rollout-policy ema, else the live ones), which entries and dtypes (the engines'
forward dtype but for what diffusers keeps in fp32 and the LoRA adapter), rank 0's dict with its checksums, and
--save-hf's folder with a full device named as such."""

from __future__ import annotations

import contextlib
import errno
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from miles.backends.fsdp_utils.checkpoint_space import CheckpointSpaceError
from miles.backends.fsdp_utils.engine_export import EngineExport
from miles.utils.weight_checksum import tensor_checksums


class Tiny(nn.Module):
    _keep_in_fp32_modules = ["norm"]

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)


class Shadow:
    """A stand-in for `ShadowWeights`: which one was swapped in."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    @contextlib.contextmanager
    def swapped_in(self, model):
        self.log.append(self.name)
        yield model


def export(**fields):
    defaults = dict(
        model=Tiny(),
        family=SimpleNamespace(),
        rank=0,
        forward_dtype=torch.float32,
        lora_config=None,
        engine_weights=None,
        shadows={},
        ema=None,
        ema_rollout_policy="live",
    )
    return EngineExport(**{**defaults, **fields})


def test_the_engines_get_the_declared_shadow_else_ema_when_asked_else_the_live_weights():
    log = []
    shadows, ema = {"old": Shadow("old", log)}, Shadow("ema", log)
    with export(engine_weights="old", shadows=shadows, ema=ema, ema_rollout_policy="ema").weights_in():
        pass
    with export(ema=ema, ema_rollout_policy="ema").weights_in():
        pass
    live = export(ema=ema, ema_rollout_policy="live")
    with live.weights_in() as model:
        assert model is live.model
    assert log == ["old", "ema"]


def test_only_the_adapter_with_lora_and_the_forward_dtype_but_for_fp32_modules_and_the_adapter():
    assert export().filters() == (None, None)  # fp32 engines: everything as stored
    keep, as_dtype = export(forward_dtype=torch.bfloat16, lora_config={"r": 4}).filters()
    assert keep("proj.lora_A.default.weight") and not keep("proj.weight")
    assert as_dtype("proj.weight") is torch.bfloat16 and as_dtype("proj.lora_B.default.weight") is None
    assert as_dtype("norm.weight") is None and as_dtype("norm.bias") is None  # diffusers keeps them in fp32


def test_rank_0_exports_the_weights_in_the_engines_dtypes_with_their_checksums(world_of_one):
    exported = export(forward_dtype=torch.bfloat16)
    weights, checksums = exported.weights()
    expected = {n: v if n.startswith("norm") else v.to(torch.bfloat16) for n, v in exported.model.state_dict().items()}
    assert list(weights) == list(expected) == list(checksums)
    assert all(weights[n].dtype == v.dtype and torch.equal(weights[n], v) for n, v in expected.items())
    assert checksums == tensor_checksums(expected)
    assert export(rank=1).weights() == (None, None)


class Family:
    def __init__(self, fail: Exception | None = None) -> None:
        self.fail, self.saved = fail, None

    def saved_transformer_dtypes(self):
        return {"proj.weight": torch.float16}

    def save_transformer(self, state, out_dir):
        if self.fail is not None:
            raise self.fail
        self.saved = (state, out_dir)


def test_save_hf_writes_the_stored_dtypes_on_rank_0_and_names_a_full_device(world_of_one, tmp_path):
    family = Family()
    assert export(family=family).save_hf(str(tmp_path / "hf")) == str(tmp_path / "hf")
    state, out_dir = family.saved
    assert out_dir == str(tmp_path / "hf") and state["proj.weight"].dtype == torch.float16
    assert state["proj.bias"].dtype == torch.float32  # not named: stored as trained
    assert export(rank=1, family=Family(OSError("never called"))).save_hf(str(tmp_path / "r1")) is None
    full = Family(OSError(errno.ENOSPC, "No space left on device"))
    with pytest.raises(CheckpointSpaceError, match=r"no space left on the device of --save-hf .* while writing the"):
        export(family=full).save_hf(str(tmp_path / "full"))
    with pytest.raises(ValueError, match="a writer's own error"):
        export(family=Family(ValueError("a writer's own error"))).save_hf(str(tmp_path / "bad"))
