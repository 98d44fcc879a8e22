"""The real-model configs shipped in miles/plan/configs (what `--plan` uses for a hub id with no local folder): each
folder is a pipeline folder its family accepts, every component model_index.json lists has its config, and the
transformer the family builds from it (meta device, no weights) has the published parameter count."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import accelerate
import pytest
import torch

from miles.models.base import get_train_pipeline_config

CONFIGS = Path(__file__).resolve().parents[3] / "miles" / "plan" / "configs"

# folder -> (family, the transformer's published parameter count); sources in miles/plan/configs/README.md
SHIPPED = {
    "black-forest-labs--FLUX.1-dev": ("flux", 11.9e9),  # flux1-dev.safetensors, 23.8 GB in bf16 (card: "12B")
    "Qwen--Qwen-Image": ("qwen-image", 20.45e9),  # transformer/ on the hub, 40.9 GB in bf16 (card: "20B")
    "Wan-AI--Wan2.1-T2V-14B-Diffusers": ("wan", 14.3e9),  # wan2.1_t2v_14B_bf16.safetensors, 28.6 GB (card: "14B")
    "stabilityai--stable-diffusion-3.5-large": ("sd3", 8.1e9),  # model card: "8.1 billion parameter"
    "hunyuanvideo-community--HunyuanVideo-1.5-Diffusers-480p_t2v": ("hunyuan-video15", 8.3e9),  # model card: "8.3B"
    "hunyuanvideo-community--HunyuanVideo-1.5-Diffusers-720p_t2v": ("hunyuan-video15", 8.3e9),
    "Lightricks--LTX-2": ("ltx2", 19e9),  # model card: "19B" audio-video transformer
}
CONFIG_FILES = {"scheduler": "scheduler_config.json", "guider": "guider_config.json"}


def test_every_shipped_folder_is_listed() -> None:
    assert sorted(p.name for p in CONFIGS.iterdir() if p.is_dir()) == sorted(SHIPPED)


def component_class(library: str, class_name: str) -> type:
    """The class a model_index.json entry names, resolved as diffusers' loader does: a library module, or a
    diffusers pipeline module ("ltx2" -> diffusers.pipelines.ltx2)."""
    try:
        module = importlib.import_module(library)
    except ModuleNotFoundError:
        module = importlib.import_module(f"diffusers.pipelines.{library}")
    return getattr(module, class_name)


@pytest.mark.parametrize("folder", sorted(SHIPPED))
def test_components_have_configs_and_exist(folder: str) -> None:
    """Every component is a class of the installed diffusers / transformers with its config file; tokenizer folders
    hold their tokenizer_config.json with model_max_length and no vocabulary files; no weight file is shipped."""
    root = CONFIGS / folder
    index = json.loads((root / "model_index.json").read_text())
    for name, spec in index.items():
        if name.startswith("_") or not isinstance(spec, list) or spec[0] is None:
            continue
        assert isinstance(component_class(*spec), type), (folder, name, spec)
        if "tokenizer" in name:
            assert "model_max_length" in json.loads((root / name / "tokenizer_config.json").read_text())
            assert [p.name for p in (root / name).iterdir()] == ["tokenizer_config.json"], (folder, name)
        else:
            assert (root / name / CONFIG_FILES.get(name, "config.json")).is_file(), (folder, name)
    suffixes = {p.suffix for p in root.rglob("*") if p.is_file()}
    assert suffixes == {".json"}, (folder, suffixes)


# SD3.5-Large's transformer computes its 192x192 sin-cos position table (90M values) at construction, for real even
# when its parameters are on the meta device: 10-20 s on a loaded CPU, so its family build runs in the standard tier
# and the fast tier counts its parameters with every tensor on the meta device instead
SLOW_BUILD = {"stabilityai--stable-diffusion-3.5-large"}


def assert_published_size(folder: str, transformer: torch.nn.Module) -> None:
    published = SHIPPED[folder][1]
    params = list(transformer.parameters())
    assert {p.device.type for p in params} == {"meta"}
    count = sum(p.numel() for p in params)
    assert abs(count - published) <= 0.02 * published, f"{folder}: {count / 1e9:.3f}B, published {published / 1e9}B"


# one family build in the fast tier (~2-3 s each); the others, and --plan on each, in the standard tier
FAST_BUILD = {"black-forest-labs--FLUX.1-dev"}


@pytest.mark.parametrize(
    "folder", [f if f in FAST_BUILD else pytest.param(f, marks=pytest.mark.standard) for f in sorted(SHIPPED)]
)
def test_family_and_transformer_size(folder: str) -> None:
    family = get_train_pipeline_config(str(CONFIGS / folder))
    assert family.name == SHIPPED[folder][0]
    assert_published_size(folder, family.load_transformer(dtype=torch.bfloat16, empty=True))


@pytest.mark.parametrize("folder", sorted(SLOW_BUILD))
def test_transformer_size_all_meta(folder: str) -> None:
    family = get_train_pipeline_config(str(CONFIGS / folder))
    assert family.name == SHIPPED[folder][0]
    cls = family.transformer_class
    with accelerate.init_empty_weights(include_buffers=True):
        transformer = cls.from_config(cls.load_config(str(CONFIGS / folder / "transformer")))
    assert_published_size(folder, transformer)


@pytest.mark.standard  # a real-size plan takes 40-180 s here: docs/user-guide/memory.md's table is these runs
@pytest.mark.parametrize("folder", sorted(SHIPPED))
def test_plan_of_each_shipped_model_at_8_gpus(folder: str, tmp_path: Path) -> None:
    """`--plan` on the hub id at --dp-size 8: the default nft run plans (the engine, every simulated rank, the auto
    sizes), its ranks issue the same collectives, and the verdict is stated with what it rests on."""
    from miles.arguments.parser import parse_args
    from miles.plan.command import plan_command

    hub_id = folder.replace("--", "/", 1)
    args = parse_args(["--plan", "--hf-checkpoint", hub_id, "--dp-size", "8", "--output-dir", str(tmp_path)])
    assert plan_command(args) in (0, 3)
    report = json.loads((tmp_path / "plan.json").read_text())
    assert report["world_size"] == 9 and report["device"] == "cuda"
    # ranks 0 and 7 in the first plan (their collectives compared); a size the auto search re-planned: rank 0 alone
    assert report["roles"]["actor"]["simulated_ranks"] in ([0, 7], [0])
    # rank 0's fp32 master shards: an eighth of the published transformer (full fine-tuning, FSDP over 8 ranks)
    assert report["roles"]["actor"]["params_bytes"] == pytest.approx(4 * SHIPPED[folder][1] / 8, rel=0.03)
    assert report["flops_per_sample"]["forward"] > 0 and report["seconds_per_rollout"]["train"] > 0
