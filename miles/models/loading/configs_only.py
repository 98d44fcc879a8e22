"""Networks and tokenizers built from a pipeline folder's configs alone, for the planner's simulation (`--plan`):
under its fake tensor mode a module built from its config holds fake weights of the real shapes, and a stand-in
tokenizer returns token ids of the length the pipeline asks for (every prompt at its longest: the plan is an upper
bound). Nothing here reads a weight file, so a folder of configs (the shipped real-model configs) is enough."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any, TypeVar

import torch
import transformers
from diffusers.configuration_utils import ConfigMixin
from diffusers.models.modeling_utils import no_init_weights
from torch import nn
from transformers import BatchEncoding, PreTrainedModel
from transformers.initialization import no_init_weights as no_transformers_init

C = TypeVar("C")
DEFAULT_TOKENS = 512  # a tokenizer folder without a model_max_length (or without a folder): tokens per prompt


class PlanTokenizer:
    """Stands in for a pipeline's tokenizer: every text becomes `max_length` tokens (or `model_max_length`), all
    attended, so the encoders see the longest prompt the flags allow. `tokenizer_from_config` mixes it into the
    folder's tokenizer class (diffusers checks a component's class), without that class's vocabulary files."""

    model_max_length: int = DEFAULT_TOKENS
    padding_side = "right"
    verbose = False

    @property
    def pad_token_id(self) -> int:
        return 0

    @property
    def eos_token_id(self) -> int:
        return 0

    def __call__(self, text: Any, *args: Any, max_length: int | None = None, **kwargs: Any) -> BatchEncoding:
        texts = [text] if isinstance(text, str) else list(text)
        length = int(max_length or self.model_max_length)
        ids = torch.zeros(len(texts), length, dtype=torch.long)
        return BatchEncoding({"input_ids": ids, "attention_mask": torch.ones_like(ids)})

    def batch_decode(self, ids: Any, *args: Any, **kwargs: Any) -> list[str]:
        return [""] * len(ids)

    def decode(self, ids: Any, *args: Any, **kwargs: Any) -> str:
        return ""

    def apply_chat_template(self, messages: Any, *args: Any, tokenize: bool = False, **kwargs: Any) -> Any:
        """The rendered text, or (`tokenize=True`) its tokens as `__call__` makes them."""
        if tokenize:
            batch = (
                messages if isinstance(messages, list) and messages and isinstance(messages[0], list) else [messages]
            )
            return self(["" for _ in batch], max_length=kwargs.get("max_length"))
        return messages if isinstance(messages, str) else json.dumps(messages, default=str)

    def tokenize(self, text: str, *args: Any, **kwargs: Any) -> list[str]:
        return []

    def __len__(self) -> int:
        return 1


def tokenizer_from_config(folder: Path, class_name: str) -> PlanTokenizer:
    """A `PlanTokenizer` that is an instance of transformers' `class_name` too (its own initialiser not run), with
    the folder's `model_max_length`."""
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    limit = config.get("model_max_length", DEFAULT_TOKENS)
    base = getattr(transformers, class_name, None) or transformers.PreTrainedTokenizerBase
    cls = type(f"Plan{class_name}", (PlanTokenizer, base), {})
    tokenizer: PlanTokenizer = object.__new__(cls)
    tokenizer.__dict__.update(_special_tokens_map={}, _added_tokens_encoder={}, init_kwargs={})  # the base's state
    tokenizer.__dict__["model_max_length"] = (
        int(limit) if isinstance(limit, int | float) and limit < 10**6 else DEFAULT_TOKENS
    )
    return tokenizer


def module_from_config(cls: type[nn.Module], folder: Path, dtype: torch.dtype) -> nn.Module:
    """`cls` (a diffusers or transformers model class) built from `folder`'s config with its weights' init skipped,
    its parameters in `dtype` (the class's `_keep_in_fp32_modules` in fp32), in eval mode."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    module: nn.Module
    try:
        if issubclass(cls, PreTrainedModel):
            if cls.config_class is None:
                raise TypeError(f"{cls.__name__} declares no config_class: it cannot be built from {folder}'s config")
            config = cls.config_class.from_pretrained(str(folder), local_files_only=True)
            with no_transformers_init():
                model = cls._from_config(config, dtype=dtype)
            model.tie_weights()  # transformers 5 ties embeddings only when asked: else counted twice
            module = model
        elif issubclass(cls, ConfigMixin):
            with no_init_weights():
                module = built_from_config(cls, folder_config(cls, folder))
        else:
            raise TypeError(f"{cls.__name__} is neither a diffusers nor a transformers model class")
    finally:
        torch.set_default_dtype(previous)
    keep_fp32_parameters(module, cls, dtype)
    return module.eval().requires_grad_(False)


def folder_config(cls: type, folder: str | Path) -> dict[str, Any]:
    """`cls.load_config(folder)` of a diffusers class: the config dict (diffusers annotates it as the pair
    `return_unused_kwargs=True` returns)."""
    if not issubclass(cls, ConfigMixin):
        raise TypeError(f"{cls.__name__} is not a diffusers ConfigMixin: it has no load_config")
    config = cls.load_config(str(folder), local_files_only=True)
    if not isinstance(config, dict):
        raise TypeError(f"{cls.__name__}.load_config({folder}) returned {type(config).__name__}; expected the config")
    return config


def built_from_config(cls: type[C], config: dict[str, Any]) -> C:
    """`cls.from_config(config)` of a diffusers class: the instance (diffusers types it with the `(instance, unused
    kwargs)` pair that `return_unused_kwargs=True` returns)."""
    if not issubclass(cls, ConfigMixin):
        raise TypeError(f"{cls.__name__} is not a diffusers ConfigMixin: it has no from_config")
    built = cls.from_config(config)
    if isinstance(built, tuple):
        raise TypeError(f"{cls.__name__}.from_config returned a tuple; expected the module alone")
    return built


def keep_fp32_parameters(module: nn.Module, cls: type[nn.Module], dtype: torch.dtype) -> None:
    """Floating parameters in `dtype`, those in the class's `_keep_in_fp32_modules` in fp32, as from_pretrained
    loads them."""
    keep = getattr(cls, "_keep_in_fp32_modules", None) or []
    for name, param in module.named_parameters():
        wanted = torch.float32 if any(m in name.split(".") for m in keep) else dtype
        if param.is_floating_point() and param.dtype != wanted:
            param.data = param.data.to(wanted)


def pipeline_components_from_configs(root: str | Path, names: set[str], dtype: torch.dtype) -> dict[str, Any]:
    """The components `names` of the pipeline folder `root` (its model_index.json's entries) built from configs:
    tokenizers as `PlanTokenizer`, networks by `module_from_config`; the rest (schedulers, processors: small config
    files) is left out, for the pipeline's own loader."""
    index = json.loads((Path(root) / "model_index.json").read_text())
    out: dict[str, Any] = {}
    for name in sorted(names):
        entry = index.get(name)
        if not isinstance(entry, list) or entry[0] is None:
            continue
        library, class_name = entry
        module = _library(library)
        if "tokenizer" in name.lower() or "Tokenizer" in class_name:
            out[name] = tokenizer_from_config(Path(root) / name, class_name)
            continue
        cls = getattr(module, class_name, None)
        if isinstance(cls, type) and issubclass(cls, nn.Module):
            out[name] = module_from_config(cls, Path(root) / name, dtype)
    return out


def _library(name: str) -> Any:
    """A model_index.json library: a package (`transformers`, `diffusers`) or a diffusers pipeline's own module
    (`ltx2` for LTX-2's connectors and vocoder), as diffusers' loader resolves it."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError:
        return importlib.import_module(f"diffusers.pipelines.{name}")
