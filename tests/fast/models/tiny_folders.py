"""The tiny pipeline folders of every family configuration, built offline once per session on first use: session
fixtures registered for the whole test tree by the root conftest (`pytest_plugins`), since tests of the trainer, the
rollout, the planner and whole runs load them too. A new family adds its folder's fixture here."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_pipeline_dir(tmp_path_factory):
    """A tiny SD3-architecture pipeline folder, built offline once per session."""
    from miles.models.sd3.tiny import save_tiny_sd3_pipeline

    path = tmp_path_factory.mktemp("tiny_sd3") / "pipeline"
    save_tiny_sd3_pipeline(str(path), seed=0)
    return str(path)


@pytest.fixture(scope="session")
def tiny_sd35_dir(tmp_path_factory):
    """A tiny SD3.5-Medium-style pipeline folder (RMS qk-norm, a dual-attention MMDiT-X block), built once."""
    from miles.models.sd3.tiny import save_tiny_sd3_pipeline

    path = tmp_path_factory.mktemp("tiny_sd35") / "pipeline"
    save_tiny_sd3_pipeline(str(path), seed=2, qk_norm="rms_norm", dual_attention_layers=(0,))
    return str(path)


@pytest.fixture(scope="session")
def tiny_flux_dev_dir(tmp_path_factory):
    """A tiny FLUX.1-dev-style (guidance-embedding) pipeline folder, built offline once per session."""
    from miles.models.flux.tiny import save_tiny_flux_pipeline

    path = tmp_path_factory.mktemp("tiny_flux_dev") / "pipeline"
    save_tiny_flux_pipeline(str(path), seed=0, guidance_embeds=True)
    return str(path)


@pytest.fixture(scope="session")
def tiny_flux_schnell_dir(tmp_path_factory):
    """A tiny FLUX.1-schnell-style (no guidance embedding: true CFG) pipeline folder, built once per session."""
    from miles.models.flux.tiny import save_tiny_flux_pipeline

    path = tmp_path_factory.mktemp("tiny_flux_schnell") / "pipeline"
    save_tiny_flux_pipeline(str(path), seed=1, guidance_embeds=False)
    return str(path)


@pytest.fixture(scope="session")
def tiny_flux_kontext_dir(tmp_path_factory):
    """A tiny FLUX.1-Kontext-dev-style (guidance-embedding) FluxKontextPipeline folder, built once per session."""
    from miles.models.flux.tiny import save_tiny_flux_pipeline

    path = tmp_path_factory.mktemp("tiny_flux_kontext") / "pipeline"
    save_tiny_flux_pipeline(str(path), seed=2, kontext=True)
    return str(path)


@pytest.fixture(scope="session")
def tiny_flux2_klein_dir(tmp_path_factory):
    """A tiny FLUX.2 [klein]-base-style (true CFG) Flux2KleinPipeline folder (Qwen3 text encoder), built once."""
    from miles.models.flux2.tiny import save_tiny_flux2_klein_pipeline

    path = tmp_path_factory.mktemp("tiny_flux2_klein") / "pipeline"
    save_tiny_flux2_klein_pipeline(str(path), seed=0)
    return str(path)


@pytest.fixture(scope="session")
def tiny_flux2_dev_dir(tmp_path_factory):
    """A tiny FLUX.2 [dev]-style (guidance embedding) Flux2Pipeline folder (Mistral3 text encoder), built once."""
    from miles.models.flux2.tiny import save_tiny_flux2_dev_pipeline

    path = tmp_path_factory.mktemp("tiny_flux2_dev") / "pipeline"
    save_tiny_flux2_dev_pipeline(str(path), seed=0)
    return str(path)


@pytest.fixture(scope="session")
def tiny_qwen_image_dir(tmp_path_factory):
    """A tiny Qwen-Image pipeline folder (Qwen2.5-VL text encoder, Qwen's video VAE), built offline once."""
    from miles.models.qwen.tiny import save_tiny_qwen_image_pipeline

    path = tmp_path_factory.mktemp("tiny_qwen_image") / "pipeline"
    save_tiny_qwen_image_pipeline(str(path), seed=0)
    return str(path)


@pytest.fixture(scope="session")
def tiny_qwen_image_edit_dir(tmp_path_factory):
    """A tiny Qwen-Image-Edit pipeline folder (the VL encoder reads the source image), built offline once."""
    from miles.models.qwen.tiny_edit import save_tiny_qwen_image_edit_pipeline

    path = tmp_path_factory.mktemp("tiny_qwen_image_edit") / "pipeline"
    save_tiny_qwen_image_edit_pipeline(str(path), seed=0)
    return str(path)


@pytest.fixture(scope="session")
def tiny_qwen_image_edit_plus_dir(tmp_path_factory):
    """A tiny Qwen-Image-Edit-Plus pipeline folder (several source images per prompt), built offline once."""
    from miles.models.qwen.tiny_edit import save_tiny_qwen_image_edit_pipeline

    path = tmp_path_factory.mktemp("tiny_qwen_image_edit_plus") / "pipeline"
    save_tiny_qwen_image_edit_pipeline(str(path), seed=0, plus=True)
    return str(path)


@pytest.fixture(scope="session")
def tiny_wan_dir(tmp_path_factory):
    """A tiny Wan 2.1-style (one expert) pipeline folder, built offline once per session."""
    from miles.models.wan.tiny import save_tiny_wan_pipeline

    path = tmp_path_factory.mktemp("tiny_wan") / "pipeline"
    save_tiny_wan_pipeline(str(path), seed=0)
    return str(path)


@pytest.fixture(scope="session")
def tiny_ltx2_dir(tmp_path_factory):
    """A tiny LTX-2-architecture (joint audio-video) pipeline folder, built offline once per session."""
    from miles.models.ltx2.tiny import save_tiny_ltx2_pipeline

    path = tmp_path_factory.mktemp("tiny_ltx2") / "pipeline"
    save_tiny_ltx2_pipeline(str(path), seed=0)
    return str(path)


@pytest.fixture(scope="session")
def tiny_hunyuan_video15_dir(tmp_path_factory):
    """A tiny HunyuanVideo-1.5-architecture text-to-video pipeline folder, built offline once per session."""
    from miles.models.hunyuan_video15.tiny import save_tiny_hunyuan_video15_pipeline

    path = tmp_path_factory.mktemp("tiny_hunyuan_video15") / "pipeline"
    save_tiny_hunyuan_video15_pipeline(str(path), seed=0)
    return str(path)


@pytest.fixture(scope="session")
def tiny_wan_2_experts_dir(tmp_path_factory):
    """A tiny Wan 2.2-A14B-style (two experts, boundary ratio 0.875) pipeline folder, built once per session."""
    from miles.models.wan.tiny import save_tiny_wan_pipeline

    path = tmp_path_factory.mktemp("tiny_wan_2_experts") / "pipeline"
    save_tiny_wan_pipeline(str(path), seed=1, two_experts=True)
    return str(path)


@pytest.fixture(scope="session")
def tiny_wan_i2v_dir(tmp_path_factory):
    """A tiny Wan 2.1 I2V-style pipeline folder (CLIP vision image branch, condition channels), built once."""
    from miles.models.wan.tiny_i2v import save_tiny_wan_i2v_pipeline

    path = tmp_path_factory.mktemp("tiny_wan_i2v") / "pipeline"
    save_tiny_wan_i2v_pipeline(str(path), seed=0)
    return str(path)


@pytest.fixture(scope="session")
def tiny_wan_i2v_2_experts_dir(tmp_path_factory):
    """A tiny Wan 2.2 I2V-A14B-style pipeline folder (no image encoder, two experts), built once per session."""
    from miles.models.wan.tiny_i2v import save_tiny_wan_i2v_pipeline

    path = tmp_path_factory.mktemp("tiny_wan_i2v_2_experts") / "pipeline"
    save_tiny_wan_i2v_pipeline(str(path), seed=1, two_experts=True)
    return str(path)


@pytest.fixture(scope="session")
def tiny_z_image_dir(tmp_path_factory):
    """A tiny Z-Image pipeline folder (Qwen3 text encoder, AutoencoderKL, Z-Image-Turbo's scheduler), built once."""
    from miles.models.z_image.tiny import save_tiny_z_image_pipeline

    path = tmp_path_factory.mktemp("tiny_z_image") / "pipeline"
    save_tiny_z_image_pipeline(str(path), seed=0)
    return str(path)
