"""The family registry: auto-detection, clear errors for bad folders, pickling, saved folders free of local paths."""

from __future__ import annotations

import ast
import json
import os
import pickle
import shutil
import subprocess
import sys
from importlib import import_module
from pathlib import Path

import pytest
import torch

from miles.models import (
    BUILTIN_FAMILIES,
    TRAIN_PIPELINE_CONFIGS,
    SD3PipelineConfig,
    all_family_classes,
    get_train_pipeline_config,
)
from miles.models.diffusers_family import DiffusersFamily
from miles.models.loading import strip_name_or_path

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_auto_detects_sd3_from_model_index(tiny_pipeline_dir):
    config = get_train_pipeline_config(tiny_pipeline_dir)
    assert type(config) is SD3PipelineConfig
    assert TRAIN_PIPELINE_CONFIGS["sd3"] is SD3PipelineConfig
    assert type(get_train_pipeline_config(tiny_pipeline_dir, family="sd3")) is SD3PipelineConfig


def test_the_built_in_table_matches_the_family_classes():
    families = all_family_classes()
    for name, entry in BUILTIN_FAMILIES.items():
        cls = families[name]
        assert (cls.name, cls.pipeline_class_name, cls.__module__) == (name, entry.pipeline_class_name, entry.module)
        assert cls.__name__ == entry.class_name and issubclass(cls, DiffusersFamily)
        assert entry.source_images == (cls.source_image_range[1] > 0), name  # what the data checks name
        assert getattr(import_module("miles.models"), cls.__name__) is cls  # the package's lazy export


def test_the_registry_says_which_families_make_video(family_case):
    """`video` in BUILTIN_FAMILIES (read before any family is imported) against each case's latent rank."""
    case, path = family_case
    family = get_train_pipeline_config(path, **case.family_options)
    assert BUILTIN_FAMILIES[case.family].video == (len(family.latent_shape(case.resolution)) != 3)


def test_no_family_imports_another_family_or_its_private_names():
    """Families share the neutral base (DiffusersFamily, packing), never a sibling's module (ARCHITECTURE §12)."""
    modules = {entry.module for entry in BUILTIN_FAMILIES.values()}
    for module in modules:
        tree = ast.parse(Path(ROOT, *module.split(".")).with_suffix(".py").read_text())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert not imported & (modules - {module}), (module, imported & modules)
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("miles")
                 for a in n.names]  # fmt: skip
        assert not [name for name in names if name.startswith("_")], (module, names)


def test_a_run_of_one_family_imports_no_other(tiny_pipeline_dir):
    """Auto-detection and the package's names import the family asked for only (in a fresh interpreter)."""
    code = (
        "import sys\n"
        "from miles.models import get_train_pipeline_config\n"
        f"config = get_train_pipeline_config({str(tiny_pipeline_dir)!r})\n"
        "from miles.models import SD3PipelineConfig\n"
        "assert type(config) is SD3PipelineConfig\n"
        "print(sorted(m for m in ('flux', 'ltx2', 'qwen_image', 'qwen_image_edit', 'wan', 'sd3') if 'miles.models.' + m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['sd3']"


def test_missing_folder_error_names_path_and_flag(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope.*--hf-checkpoint"):
        get_train_pipeline_config(str(missing))


def test_folder_without_model_index_error_names_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"{tmp_path}.*model_index.json.*--hf-checkpoint"):
        SD3PipelineConfig(str(tmp_path))


@pytest.mark.parametrize("content", [b"\x89PNG\r\n\x1a\n\x00\xff\xfe", b'{"_class_name": "StableDiffusion3Pi'])
def test_a_model_index_that_is_not_json_is_named_with_its_folder(tmp_path, content):
    (tmp_path / "model_index.json").write_bytes(content)
    with pytest.raises(ValueError, match=rf"{tmp_path}/model_index.json is not JSON .*: {tmp_path} is not a diffusers"):
        get_train_pipeline_config(str(tmp_path))
    with pytest.raises(ValueError, match=rf"{tmp_path}/model_index.json is not JSON"):
        get_train_pipeline_config(str(tmp_path), family="sd3")


def test_unknown_pipeline_class_lists_known_families(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "CogVideoXPipeline"}))
    with pytest.raises(
        ValueError,
        match=r"CogVideoXPipeline.*flux \(FluxPipeline\), flux-kontext \(FluxKontextPipeline\), flux2 \(Flux2KleinPipeline\), flux2-dev \(Flux2Pipeline\), hunyuan-video15 \(HunyuanVideo15Pipeline\), ltx2 \(LTX2Pipeline\), "
        r"qwen-image \(QwenImagePipeline\), qwen-image-edit \(QwenImageEditPipeline\), "
        r"qwen-image-edit-plus \(QwenImageEditPlusPipeline\), sd3 \(StableDiffusion3Pipeline\), "
        r"wan \(WanPipeline\), wan-i2v \(WanImageToVideoPipeline\), z-image \(ZImagePipeline\)",
    ):
        get_train_pipeline_config(str(tmp_path))


def test_unknown_family_name_lists_known_families(tiny_pipeline_dir):
    with pytest.raises(ValueError, match="unknown model family 'cogvideox'.*sd3.*wan"):
        get_train_pipeline_config(tiny_pipeline_dir, family="cogvideox")


def test_pickled_config_carries_the_path_not_loaded_models(tiny_pipeline_dir):
    config = get_train_pipeline_config(tiny_pipeline_dir)
    config._loaded["vae"] = torch.nn.Linear(1000, 1000)
    restored = pickle.loads(pickle.dumps(config))
    assert restored.path == config.path and restored._loaded == {}
    assert "vae" in config._loaded


def _absolute_paths(value) -> list[str]:
    """Every string inside a JSON value that looks like an absolute path of two or more parts (vocabularies hold
    tokens like "/")."""
    if isinstance(value, dict):
        return [p for v in value.values() for p in _absolute_paths(v)]
    if isinstance(value, list):
        return [p for v in value for p in _absolute_paths(v)]
    return [value] if isinstance(value, str) and value.startswith("/") and value.count("/") >= 2 else []


def test_strip_name_or_path_removes_only_that_key(tmp_path):
    (tmp_path / "vae").mkdir()
    (tmp_path / "vae" / "config.json").write_text(json.dumps({"_name_or_path": "/home/me/vae", "latent_channels": 4}))
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusion3Pipeline"}))
    assert strip_name_or_path(tmp_path) == [tmp_path / "vae" / "config.json"]
    assert json.loads((tmp_path / "vae" / "config.json").read_text()) == {"latent_channels": 4}
    assert json.loads((tmp_path / "model_index.json").read_text()) == {"_class_name": "StableDiffusion3Pipeline"}


def test_shipped_and_saved_pipelines_name_no_absolute_path(tmp_path):
    from diffusers import AutoencoderKL

    from miles.models.builtin import SHIPPED_SHAPES_DIR

    shipped = {str(f): _absolute_paths(json.loads(f.read_text())) for f in Path(SHIPPED_SHAPES_DIR).rglob("*.json")}
    assert not any(shipped.values()), shipped
    # a component loaded from a folder records it in its config, which save_pretrained writes back
    source = tmp_path / "source"
    shutil.copytree(SHIPPED_SHAPES_DIR, source)
    AutoencoderKL.from_pretrained(str(source), subfolder="vae").save_pretrained(str(source / "vae"))
    assert _absolute_paths(json.loads((source / "vae" / "config.json").read_text()))  # the leak being guarded
    family = get_train_pipeline_config(str(source))
    state = family.load_transformer().state_dict()
    out = Path(family.save_transformer(state, str(tmp_path / "saved")))
    saved = {str(f): _absolute_paths(json.loads(f.read_text())) for f in out.rglob("*.json")}
    assert not any(saved.values()), saved
    assert not any(str(tmp_path) in f.read_text() for f in out.rglob("*.json"))


def test_a_missing_component_is_named_with_its_class(tmp_path, family_case):
    case, path = family_case
    index = json.loads((Path(path) / "model_index.json").read_text())
    components = [name for name, spec in index.items() if isinstance(spec, list) and spec[1] is not None]
    assert {"transformer", "vae", "scheduler"} <= set(components)
    for component in components:
        folder = tmp_path / component  # the pipeline folder without that component (links to the others)
        folder.mkdir()
        for child in Path(path).iterdir():
            if child.name != component:
                (folder / child.name).symlink_to(child)
        with pytest.raises(
            FileNotFoundError, match=rf"complete {case.family} pipeline.*'{component}' \({index[component][1]}\)"
        ):
            get_train_pipeline_config(str(folder))
