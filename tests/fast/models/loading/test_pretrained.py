"""Pipeline folders: clear errors for a missing folder, model index or component, and saved folders free of local
paths (`_name_or_path` stripped)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from miles.models import (
    SD3PipelineConfig,
    get_train_pipeline_config,
)
from miles.models.loading.pretrained import strip_name_or_path


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


def test_strip_name_or_path_removes_only_that_key(tmp_path):
    (tmp_path / "vae").mkdir()
    (tmp_path / "vae" / "config.json").write_text(json.dumps({"_name_or_path": "/home/me/vae", "latent_channels": 4}))
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusion3Pipeline"}))
    assert strip_name_or_path(tmp_path) == [tmp_path / "vae" / "config.json"]
    assert json.loads((tmp_path / "vae" / "config.json").read_text()) == {"latent_channels": 4}
    assert json.loads((tmp_path / "model_index.json").read_text()) == {"_class_name": "StableDiffusion3Pipeline"}


def _absolute_paths(value) -> list[str]:
    """Every string inside a JSON value that looks like an absolute path of two or more parts (vocabularies hold
    tokens like "/")."""
    if isinstance(value, dict):
        return [p for v in value.values() for p in _absolute_paths(v)]
    if isinstance(value, list):
        return [p for v in value for p in _absolute_paths(v)]
    return [value] if isinstance(value, str) and value.startswith("/") and value.count("/") >= 2 else []


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
