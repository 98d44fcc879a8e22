"""Named built-in checkpoints: `builtin:tiny-shapes`, `builtin:tiny-shapes-edit` and `builtin:tiny-moving-shapes`
(shipped, pretrained on the shapes world, the shapes edit world and the moving-shapes video world) and one random tiny folder per family (`builtin:tiny-sd3`, `builtin:tiny-wan`, ...),
built on first use into the cache under a file lock. Torch-free until a folder is built."""

from __future__ import annotations

import fcntl
import json
import logging
import os
from importlib import import_module
from typing import Any, NamedTuple

from miles.models.registry import BUILTIN_FAMILIES, builtin_family_of_pipeline

logger = logging.getLogger(__name__)

BUILTIN_SHAPES_MODEL = "builtin:tiny-shapes"  # pretrained on the shapes world, shipped in the package (§9)
ASSETS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")
SHIPPED_SHAPES_DIR = os.path.join(ASSETS_DIR, "tiny_shapes_sd3")
BUILTIN_SHAPES_EDIT_MODEL = "builtin:tiny-shapes-edit"  # a FLUX.1 Kontext-architecture editor of the shapes edit world
SHIPPED_SHAPES_EDIT_DIR = os.path.join(ASSETS_DIR, "tiny_shapes_edit")
BUILTIN_MOVING_SHAPES_MODEL = "builtin:tiny-moving-shapes"  # a Wan-architecture video model of the moving-shapes world
SHIPPED_MOVING_SHAPES_DIR = os.path.join(ASSETS_DIR, "tiny_moving_shapes")
# pretrained folders shipped in the package: name -> (folder, the script that rebuilds it)
SHIPPED_FOLDERS: dict[str, tuple[str, str]] = {
    BUILTIN_SHAPES_MODEL: (SHIPPED_SHAPES_DIR, "scripts/pretrain_tiny_shapes.py"),
    BUILTIN_SHAPES_EDIT_MODEL: (SHIPPED_SHAPES_EDIT_DIR, "scripts/pretrain_tiny_shapes_edit.py"),
    BUILTIN_MOVING_SHAPES_MODEL: (SHIPPED_MOVING_SHAPES_DIR, "scripts/pretrain_tiny_moving_shapes.py"),
}


class TinyFolder(NamedTuple):
    family: str  # the BUILTIN_FAMILIES name of its pipeline class
    builder: str  # "module:function" writing the folder: function(path, seed=0, **kwargs)
    kwargs: dict[str, Any] = {}


# random weights (seed 0) at toy sizes: plumbing, the family contract tests, a newcomer's first run of a family
TINY_FOLDERS: dict[str, TinyFolder] = {
    "builtin:tiny-sd3": TinyFolder("sd3", "miles.models.sd3.tiny:save_tiny_sd3_pipeline"),
    "builtin:tiny-flux": TinyFolder("flux", "miles.models.flux.tiny:save_tiny_flux_pipeline"),
    "builtin:tiny-flux-kontext": TinyFolder(
        "flux-kontext", "miles.models.flux.tiny:save_tiny_flux_pipeline", {"kontext": True}
    ),
    "builtin:tiny-flux2-klein": TinyFolder("flux2", "miles.models.flux2.tiny:save_tiny_flux2_klein_pipeline"),
    "builtin:tiny-flux2-dev": TinyFolder("flux2-dev", "miles.models.flux2.tiny:save_tiny_flux2_dev_pipeline"),
    "builtin:tiny-qwen-image": TinyFolder("qwen-image", "miles.models.qwen.tiny:save_tiny_qwen_image_pipeline"),
    "builtin:tiny-qwen-image-edit": TinyFolder(
        "qwen-image-edit", "miles.models.qwen.tiny_edit:save_tiny_qwen_image_edit_pipeline"
    ),
    "builtin:tiny-qwen-image-edit-plus": TinyFolder(
        "qwen-image-edit-plus", "miles.models.qwen.tiny_edit:save_tiny_qwen_image_edit_pipeline", {"plus": True}
    ),
    "builtin:tiny-wan": TinyFolder("wan", "miles.models.wan.tiny:save_tiny_wan_pipeline"),
    "builtin:tiny-wan-2-experts": TinyFolder(
        "wan", "miles.models.wan.tiny:save_tiny_wan_pipeline", {"two_experts": True}
    ),
    "builtin:tiny-wan-i2v": TinyFolder("wan-i2v", "miles.models.wan.tiny_i2v:save_tiny_wan_i2v_pipeline"),
    "builtin:tiny-hunyuan-video15": TinyFolder(
        "hunyuan-video15", "miles.models.hunyuan_video15.tiny:save_tiny_hunyuan_video15_pipeline"
    ),
    "builtin:tiny-ltx2": TinyFolder("ltx2", "miles.models.ltx2.tiny:save_tiny_ltx2_pipeline"),
    "builtin:tiny-z-image": TinyFolder("z-image", "miles.models.z_image.tiny:save_tiny_z_image_pipeline"),
}
BUILTIN_TINY = "builtin:tiny-sd3"  # the tiny folder of the default family
BUILTIN_NAMES = (*SHIPPED_FOLDERS, *TINY_FOLDERS)


def cache_dir() -> str:
    return os.environ.get("MILES_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "miles"))


def resolve_checkpoint(path: str | None) -> str | None:
    """Map a builtin name to a pipeline folder, building a tiny one under a file lock the first time; other paths
    pass."""
    if path in SHIPPED_FOLDERS:
        folder, script = SHIPPED_FOLDERS[path]
        if not os.path.isfile(os.path.join(folder, "model_index.json")):
            raise FileNotFoundError(
                f"--hf-checkpoint {path}: the shipped folder {folder} is missing; reinstall miles or rebuild it "
                f"with {script}"
            )
        return folder
    if path is None or not path.startswith("builtin:"):
        return path
    if path not in TINY_FOLDERS:
        raise ValueError(f"unknown built-in checkpoint {path!r}; known: {', '.join(BUILTIN_NAMES)}")
    return build_tiny_folder(path)


def build_tiny_folder(name: str) -> str:
    """The cached folder of the tiny checkpoint `name`, built (seed 0) by the first process that asks for it while
    the others wait on its lock."""
    folder = TINY_FOLDERS[name]
    target = os.path.join(cache_dir(), f"{name.removeprefix('builtin:')}-seed0")
    os.makedirs(cache_dir(), exist_ok=True)
    with open(target + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.isfile(os.path.join(target, "model_index.json")):
            logger.info("building %s into %s", name, target)
            module, function = folder.builder.split(":")
            tmp = target + ".tmp"
            getattr(import_module(module), function)(tmp, seed=0, **folder.kwargs)  # torch and diffusers: on use only
            os.replace(tmp, target)
    return target


def builtin_family_name(hf_checkpoint: str | None, model_family: str = "auto") -> str | None:
    """The built-in family a run's model belongs to, answered without importing a family: by the built-in name, the
    --model-family, or the folder's model_index.json pipeline class. None when unknown (a user's family, a folder
    that is not there yet: the start-up checks name those)."""
    family = model_family if model_family in BUILTIN_FAMILIES else None
    if family is None and hf_checkpoint in TINY_FOLDERS:
        family = TINY_FOLDERS[hf_checkpoint].family
    if family is None and hf_checkpoint in SHIPPED_FOLDERS and model_family == "auto":
        hf_checkpoint = SHIPPED_FOLDERS[hf_checkpoint][0]  # its model_index.json says
    if family is None and hf_checkpoint and not hf_checkpoint.startswith("builtin:") and model_family == "auto":
        try:
            with open(os.path.join(hf_checkpoint, "model_index.json")) as f:
                family = builtin_family_of_pipeline(json.load(f).get("_class_name"))
        except (OSError, ValueError, AttributeError):
            return None
    return family


def makes_video(hf_checkpoint: str | None, model_family: str = "auto") -> bool:
    """Whether a run's model makes video (False when its family is unknown: `builtin_family_name`)."""
    family = builtin_family_name(hf_checkpoint, model_family)
    return family is not None and BUILTIN_FAMILIES[family].video
