"""Local diffusers pipeline folders and their weights: the folder checks, `load_pretrained` (whole or empty, for the
sharded loader), a network's compute dtype and the dtypes of safetensors files. Torch and diffusers, no family."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TypeVar, cast

import accelerate
import diffusers.utils.deprecation_utils
import torch
from diffusers.configuration_utils import ConfigMixin
from diffusers.models.modeling_utils import ModelMixin, no_init_weights
from torch import nn

from miles.models.loading.configs_only import built_from_config, folder_config, keep_fp32_parameters, module_from_config
from miles.utils.simulation import simulating

# from_pretrained's dtype keyword: `dtype` in the diffusers versions that renamed it, `torch_dtype` before
DTYPE_KW = "dtype" if hasattr(diffusers.utils.deprecation_utils, "_resolve_dtype") else "torch_dtype"
# safetensors' dtype names (a file header's "dtype") -> torch dtypes
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
# where `load_pretrained(..., empty=True)` records the folder whose safetensors hold a module's weights
CHECKPOINT_FOLDER_ATTR = "_miles_checkpoint_folder"
M = TypeVar("M", bound=ModelMixin)
N = TypeVar("N", bound=nn.Module)


def load_pretrained(
    cls: type[M], root: str | Path, subfolder: str | None, dtype: torch.dtype, *, empty: bool = False
) -> M:
    """`cls.from_pretrained(root, subfolder=..., dtype=...)` in eval mode, or with `empty=True` the same module with
    its parameters on the meta device and no weights read, tagged with its weights' folder (`CHECKPOINT_FOLDER_ATTR`)
    so that a sharded loader can fill each rank's shards from the files (`miles.backends.fsdp_utils.sharded_load`).

    The empty module is built as from_pretrained builds it: under `dtype` as the default dtype (buffers computed at
    construction get it), weights initialisation skipped, and the class's `_keep_in_fp32_modules` parameters in fp32.

    Under the planner's simulation (`miles.utils.simulation`) no weight file is read: the module is built from its
    config with fake weights (`module_from_config`).
    """
    folder = Path(root) / subfolder if subfolder else Path(root)
    if not empty:
        if simulating():
            return cast(M, module_from_config(cls, folder, dtype))  # `cls.from_config`'s (a ModelMixin: Self)
        return cls.from_pretrained(str(root), subfolder=subfolder, **{DTYPE_KW: dtype}, local_files_only=True).eval()
    config = folder_config(cls, folder)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with no_init_weights(), accelerate.init_empty_weights(include_buffers=False):
            model = built_from_config(cls, config)
    finally:
        torch.set_default_dtype(previous)
    if simulating():
        _parameters_to_meta(model)
    keep_fp32_parameters(model, cls, dtype)
    setattr(model, CHECKPOINT_FOLDER_ATTR, folder)
    return model.eval()


def _parameters_to_meta(model: nn.Module) -> None:
    """Under the planner's fake tensors, put on the meta device the parameters `init_empty_weights` left on the CPU:
    accelerate re-creates each parameter with the old one's `__dict__`, which on a fake tensor names its device
    (`_fake_device`), so they stayed fake CPU tensors, which a real run's empty module never holds (the plan then
    counted the whole model once more at a trainer's start-up: 1.9x a world-size-1 start-up)."""
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and not param.is_meta:
                module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)


def as_class(module: nn.Module, cls: type[N]) -> N:
    """`module`, which must be a `cls` (a family's transformer as its own class, from the families' `nn.Module`
    contract); a TypeError naming both otherwise."""
    if not isinstance(module, cls):
        raise TypeError(f"expected a {cls.__name__}, got a {type(module).__name__}")
    return module


def module_config(module: nn.Module) -> dict[str, Any]:
    """A diffusers model's config (`ConfigMixin.config`: its constructor's arguments)."""
    if not isinstance(module, ConfigMixin):
        raise TypeError(f"{type(module).__name__} is not a diffusers model (a ConfigMixin): it has no config")
    return module.config


def moved_to(module: N, device: torch.device | str) -> N:
    """`module.to(device)` (its own `to`: a diffusers model keeps its fp32 modules), which moves it in place, typed
    as `module`: diffusers declares `ModelMixin.to` with `functools.wraps(nn.Module.to)`, which mypy reads as the
    unbound method (its `self` first)."""
    as_module: nn.Module = module
    as_module.to(device)
    return module


def compute_dtype(network: nn.Module) -> torch.dtype:
    """The dtype a network's forward runs in: the `compute_dtype` a mixed-precision wrapper set on it or on a module
    inside it (FSDP2 stores fp32 master weights and computes in its param dtype), else its parameters' dtype (of those
    not kept in fp32: a bf16 Wan loaded by from_pretrained holds fp32 norms and tables first).

    A family's `predict_velocity` casts its inputs to this dtype, so engines and trainer cast alike."""
    kept: set[str] = set()  # modules diffusers keeps in fp32 whatever the dtype (Wan's scale_shift_table, norms)
    for module in network.modules():
        dtype = module.__dict__.get("compute_dtype")
        if dtype is not None:
            return dtype
        kept.update(getattr(module, "_keep_in_fp32_modules", None) or ())
    for name, param in network.named_parameters():
        if not kept.intersection(name.split(".")):
            return param.dtype
    return next(network.parameters()).dtype


def check_pipeline_folder(path: str | Path) -> Path:
    """`path` as a Path if it is a local diffusers pipeline folder (has model_index.json); a clear error otherwise."""
    folder = Path(path).expanduser()
    hint = "--hf-checkpoint must be a local diffusers pipeline folder (nothing is downloaded)"
    if not folder.exists():
        raise FileNotFoundError(f"pipeline folder {str(path)!r} does not exist; {hint}")
    if not folder.is_dir():
        raise NotADirectoryError(f"pipeline path {str(path)!r} is not a folder; {hint}")
    if not (folder / "model_index.json").is_file():
        raise FileNotFoundError(f"{str(path)!r} has no model_index.json; {hint}")
    return folder


def read_model_index(folder: Path) -> dict[str, Any]:
    """The folder's model_index.json as a dict; an error naming the file and the folder when it is not a JSON object
    (binary bytes, truncated text)."""
    file = folder / "model_index.json"
    try:
        index = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{file} is not JSON ({exc}): {folder} is not a diffusers pipeline folder") from None
    if not isinstance(index, dict):
        raise ValueError(f"{file} is not a JSON object: {folder} is not a diffusers pipeline folder")
    return index


def check_pipeline_components(folder: Path, family: str) -> Path:
    """`folder` if every component its model_index.json lists (`"vae": ["diffusers", "AutoencoderKL"]`; null entries
    are absent by design) has its subfolder; an error naming the first missing component and its class otherwise
    (diffusers would fail less clearly, and a missing tokenizer folder can even load as an empty tokenizer)."""
    index = read_model_index(folder)
    for component, spec in index.items():
        if component.startswith("_") or not isinstance(spec, list) or len(spec) != 2 or spec[1] is None:
            continue
        if not (folder / component).is_dir():
            raise FileNotFoundError(
                f"{folder} is not a complete {family} pipeline folder: model_index.json lists the component "
                f"{component!r} ({spec[1]}), but {folder / component} is missing"
            )
    return folder


def strip_name_or_path(folder: str | Path) -> list[Path]:
    """Remove `_name_or_path` from every JSON file under `folder`: from_pretrained records the folder a component
    was loaded from there, and save_pretrained writes it back, so a saved pipeline would name the machine it was
    built on. Returns the files rewritten."""
    rewritten = []
    for file in sorted(Path(folder).rglob("*.json")):
        data = json.loads(file.read_text())
        if isinstance(data, dict) and "_name_or_path" in data:
            del data["_name_or_path"]
            file.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
            rewritten.append(file)
    return rewritten
