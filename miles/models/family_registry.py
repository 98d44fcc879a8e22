"""The registered model families: a family class registers under its name (`register_train_pipeline_config`), and a
run finds it by name, by its folder's pipeline class or by a user's class path (`get_train_pipeline_config`). The
built-in families are imported on first use (`miles.models.registry`). `miles.models.base` re-exports these names."""

from __future__ import annotations

import inspect
from importlib import import_module
from typing import TYPE_CHECKING, Any, TypeVar

from miles.models.loading.pretrained import check_pipeline_folder, read_model_index
from miles.models.registry import BUILTIN_FAMILIES, builtin_family_of_pipeline
from miles.utils import import_gc
from miles.utils.misc import load_function

if TYPE_CHECKING:
    from miles.models.base import TrainPipelineConfig

TRAIN_PIPELINE_CONFIGS: dict[str, type[TrainPipelineConfig]] = {}  # the families imported so far, by name

_C = TypeVar("_C", bound="type[TrainPipelineConfig]")


def register_train_pipeline_config(cls: _C) -> _C:
    """Class decorator: make a family available under `cls.name`."""
    if cls.name in TRAIN_PIPELINE_CONFIGS and TRAIN_PIPELINE_CONFIGS[cls.name] is not cls:
        raise ValueError(f"model family {cls.name!r} is already registered by {TRAIN_PIPELINE_CONFIGS[cls.name]}")
    TRAIN_PIPELINE_CONFIGS[cls.name] = cls
    return cls


def family_class(name: str) -> type[TrainPipelineConfig] | None:
    """The family registered under `name`, importing a built-in one on first use; None when there is none."""
    if name not in TRAIN_PIPELINE_CONFIGS and name in BUILTIN_FAMILIES:
        with import_gc.paused():  # diffusers' pipelines and transformers' models, less CPU (import_gc)
            import_module(BUILTIN_FAMILIES[name].module)  # its decorator registers it
    return TRAIN_PIPELINE_CONFIGS.get(name)


def family_for_pipeline(class_name: str | None) -> type[TrainPipelineConfig] | None:
    """The family that handles the pipeline class `class_name` (model_index.json's `_class_name`): a registered
    one first (a user's family may take over a built-in pipeline class), then a built-in one; None when none does."""
    for cls in TRAIN_PIPELINE_CONFIGS.values():
        if cls.pipeline_class_name == class_name:
            return cls
    name = builtin_family_of_pipeline(class_name)
    return None if name is None else family_class(name)


def all_family_classes() -> dict[str, type[TrainPipelineConfig]]:
    """Every family, by name: the built-in ones (each imported) and those registered since."""
    for name in BUILTIN_FAMILIES:
        family_class(name)
    return dict(TRAIN_PIPELINE_CONFIGS)


def _known_families() -> str:
    """Each family's name and pipeline class, without importing a built-in one."""
    known = {name: entry.pipeline_class_name for name, entry in BUILTIN_FAMILIES.items()}
    known.update((name, cls.pipeline_class_name) for name, cls in TRAIN_PIPELINE_CONFIGS.items())
    return ", ".join(f"{name} ({pipeline})" for name, pipeline in sorted(known.items())) or "none"


def is_family_class_path(family: str) -> bool:
    """`file.py:Class` or `package.module.Class` (a user's family class), as opposed to a registered name."""
    return ":" in family or "." in family


def load_family_class(spec: str) -> type[TrainPipelineConfig]:
    """A user's model family class from `file.py:Class` or `package.module.Class`, registered under its `name`
    (--train-pipeline-config-path); a clear error when it is not a complete TrainPipelineConfig."""
    from miles.models.base import TrainPipelineConfig  # the contract imports this module (its sp check)

    cls = load_function(spec)
    if not (isinstance(cls, type) and issubclass(cls, TrainPipelineConfig)):
        raise TypeError(f"--train-pipeline-config-path {spec}: {cls!r} is not a TrainPipelineConfig subclass")
    missing = sorted(getattr(cls, "__abstractmethods__", ()))
    unnamed = [attr for attr in ("name", "pipeline_class_name") if not isinstance(getattr(cls, attr, None), str)]
    if missing or unnamed:
        raise TypeError(
            f"--train-pipeline-config-path {spec}: {cls.__name__} must define "
            + ", ".join([*(f"class attribute {a}" for a in unnamed), *(f"method {m}" for m in missing)])
        )
    try:  # start-up calls it with the run's algorithm record (a family written before it took one fails here)
        inspect.signature(cls.check_run_args).bind(None, None, None)
    except TypeError:
        raise TypeError(
            f"--train-pipeline-config-path {spec}: {cls.__name__}.check_run_args must take (self, args, algorithm)"
        ) from None
    return register_train_pipeline_config(cls)


def get_train_pipeline_config(path: str, family: str = "auto", **options: Any) -> TrainPipelineConfig:
    """The family config for the pipeline folder `path`; "auto" picks it by model_index.json's `_class_name`, a
    class path (`file.py:Class`, from --train-pipeline-config-path) loads and registers the user's family.

    `options` (see `family_options`): the ones not None go to the family's constructor, which refuses those it
    does not accept."""
    folder = check_pipeline_folder(path)
    given = {k: v for k, v in options.items() if v is not None}  # a user's family may take the path only
    if is_family_class_path(family):
        return load_family_class(family)(str(folder), **given)
    if family != "auto":
        cls = family_class(family)
        if cls is None:
            raise ValueError(f"unknown model family {family!r}; known families: {_known_families()}")
        return cls(str(folder), **given)
    class_name = read_model_index(folder).get("_class_name")
    cls = family_for_pipeline(class_name)
    if cls is not None:
        return cls(str(folder), **given)
    raise ValueError(
        f"{path}/model_index.json names pipeline class {class_name!r}, which no model family handles; "
        f"known families: {_known_families()}"
    )
