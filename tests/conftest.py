"""Shared, expensive fixtures: the tiny pipeline folders, one Ray cluster per test session, and the model-family
cases of the family contract suite (`FAMILY_CASES`: one line per family configuration)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_pipeline_dir(tmp_path_factory):
    """A tiny SD3-architecture pipeline folder, built offline once per session."""
    from miles.models.tiny import save_tiny_sd3_pipeline

    path = tmp_path_factory.mktemp("tiny_sd3") / "pipeline"
    save_tiny_sd3_pipeline(str(path), seed=0)
    return str(path)


@pytest.fixture(scope="session")
def tiny_sd35_dir(tmp_path_factory):
    """A tiny SD3.5-Medium-style pipeline folder (RMS qk-norm, a dual-attention MMDiT-X block), built once."""
    from miles.models.tiny import save_tiny_sd3_pipeline

    path = tmp_path_factory.mktemp("tiny_sd35") / "pipeline"
    save_tiny_sd3_pipeline(str(path), seed=2, qk_norm="rms_norm", dual_attention_layers=(0,))
    return str(path)


@pytest.fixture(scope="session")
def tiny_flux_dev_dir(tmp_path_factory):
    """A tiny FLUX.1-dev-style (guidance-embedding) pipeline folder, built offline once per session."""
    from miles.models.tiny_flux import save_tiny_flux_pipeline

    path = tmp_path_factory.mktemp("tiny_flux_dev") / "pipeline"
    save_tiny_flux_pipeline(str(path), seed=0, guidance_embeds=True)
    return str(path)


@pytest.fixture(scope="session")
def tiny_flux_schnell_dir(tmp_path_factory):
    """A tiny FLUX.1-schnell-style (no guidance embedding: true CFG) pipeline folder, built once per session."""
    from miles.models.tiny_flux import save_tiny_flux_pipeline

    path = tmp_path_factory.mktemp("tiny_flux_schnell") / "pipeline"
    save_tiny_flux_pipeline(str(path), seed=1, guidance_embeds=False)
    return str(path)


@pytest.fixture(scope="session")
def tiny_wan_dir(tmp_path_factory):
    """A tiny Wan 2.1-style (one expert) pipeline folder, built offline once per session."""
    from miles.models.tiny_wan import save_tiny_wan_pipeline

    path = tmp_path_factory.mktemp("tiny_wan") / "pipeline"
    save_tiny_wan_pipeline(str(path), seed=0)
    return str(path)


@pytest.fixture(scope="session")
def tiny_wan_2_experts_dir(tmp_path_factory):
    """A tiny Wan 2.2-A14B-style (two experts, boundary ratio 0.875) pipeline folder, built once per session."""
    from miles.models.tiny_wan import save_tiny_wan_pipeline

    path = tmp_path_factory.mktemp("tiny_wan_2_experts") / "pipeline"
    save_tiny_wan_pipeline(str(path), seed=1, two_experts=True)
    return str(path)


def _same_layout(pipe: Any, latents: Any, resolution: int) -> Any:
    return latents


def _flux_unpacked(pipe: Any, latents: Any, resolution: int) -> Any:
    return pipe._unpack_latents(latents, resolution, resolution, pipe.vae_scale_factor)


@dataclass(frozen=True)
class FamilyCase:
    """How the family contract suite drives one family configuration through its own diffusers pipeline."""

    id: str
    family: str  # the registered model family name
    fixture: str  # the session fixture that builds its tiny pipeline folder
    pipeline_class: str  # the diffusers class that loads the folder
    cfg_kwargs: Callable[[float], dict[str, Any]]  # the pipeline __call__ kwargs of miles' guidance scale w
    to_family_latents: Callable[[Any, Any, int], Any]  # the pipeline's latents -> the family's latent layout
    call_kwargs: dict[str, Any] = field(default_factory=lambda: {"max_sequence_length": 32})
    resolution: int = 32
    # one run of every loss type at dp 2; off where another test already runs them on the same family code
    loss_runs: bool = True
    num_frames: int | None = None  # video families: frames per sample (the pipeline's num_frames)
    family_options: dict[str, Any] = field(default_factory=dict)  # get_train_pipeline_config / engine options
    run_args: tuple[str, ...] = ()  # flags of the whole runs that give the same options
    output_attr: str = "images"  # the pipeline output's field holding the media (video pipelines: "frames")

    @property
    def pipeline_kwargs(self) -> dict[str, Any]:
        """Size kwargs of the pipeline's __call__ plus `call_kwargs`."""
        frames = {} if self.num_frames is None else {"num_frames": self.num_frames}
        return {"height": self.resolution, "width": self.resolution, **frames, **self.call_kwargs}

    @property
    def media_shape(self) -> tuple[int, ...]:
        """One decoded sample, channels last: (H, W, 3) images or (F, H, W, 3) frames."""
        frames = () if self.num_frames is None else (self.num_frames,)
        return (*frames, self.resolution, self.resolution, 3)


FAMILY_CASES = [
    # test_golden.py runs every loss type on SD3 at dp 2 already
    FamilyCase(
        "sd3",
        "sd3",
        "tiny_pipeline_dir",
        "StableDiffusion3Pipeline",
        lambda w: {"guidance_scale": w},
        _same_layout,
        loss_runs=False,
    ),
    # SD3.5 on the sd3 family; the pipeline's default skip_guidance_layers is None (no skip-layer guidance)
    FamilyCase(
        "sd3.5",
        "sd3",
        "tiny_sd35_dir",
        "StableDiffusion3Pipeline",
        lambda w: {"guidance_scale": w},
        _same_layout,
        loss_runs=False,
    ),
    FamilyCase(
        "flux-dev", "flux", "tiny_flux_dev_dir", "FluxPipeline", lambda w: {"guidance_scale": w}, _flux_unpacked
    ),
    # the same family code as flux-dev but for guidance, which the parity runs cover
    FamilyCase(
        "flux-schnell",
        "flux",
        "tiny_flux_schnell_dir",
        "FluxPipeline",
        lambda w: {"true_cfg_scale": w, "negative_prompt": "", "guidance_scale": 0.0},
        _flux_unpacked,
        loss_runs=False,
    ),
    FamilyCase(
        "wan",
        "wan",
        "tiny_wan_dir",
        "WanPipeline",
        lambda w: {"guidance_scale": w},
        _same_layout,
        num_frames=5,
        family_options={"num_frames": 5},
        run_args=("--resolution", "32", "--num-frames", "5"),
        output_attr="frames",
    ),
    # Wan 2.2 A14B layout: the steps route to both experts, the low-noise one guided by its own scale; its loss
    # types run through the same code as wan's but for the routing, which the parity runs cover
    FamilyCase(
        "wan-2-experts",
        "wan",
        "tiny_wan_2_experts_dir",
        "WanPipeline",
        lambda w: {"guidance_scale": w, "guidance_scale_2": 2.0},
        _same_layout,
        loss_runs=False,
        num_frames=5,
        family_options={"num_frames": 5, "guidance_scale_2": 2.0},
        run_args=("--resolution", "32", "--num-frames", "5", "--diffusion-guidance-scale-2", "2.0"),
        output_attr="frames",
    ),
]


@pytest.fixture(params=FAMILY_CASES, ids=[case.id for case in FAMILY_CASES])
def family_case(request):
    """(case, pipeline folder) for every family configuration of FAMILY_CASES."""
    return request.param, request.getfixturevalue(request.param.fixture)


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    """One local Ray cluster for the whole session (actors ask for fractional CPUs)."""
    import ray

    temp_dir = tmp_path_factory.mktemp("ray")
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        _temp_dir=str(temp_dir),
        log_to_driver=False,
        configure_logging=False,
    )
    yield ray
    ray.shutdown()
