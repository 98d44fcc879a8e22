"""The model-family cases of the family contract suite (`FAMILY_CASES`: one line per family configuration, naming
its tiny folder's fixture of `tiny_folders.py`) and how each family's diffusers pipeline is driven to compare with
it. A new family adds its case here; the test tree's root stays family-agnostic."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.fast.models.pipeline_layouts import (
    FLUX2_CALL_KWARGS,
    FLUX2_DEV_CALL_KWARGS,
    flux2_patchified,
    flux_unpacked,
    ltx2_joint,
    qwen_edit_reference_area,
    qwen_image_unpacked,
    same_layout,
)


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
    # its loss-type runs go to the standard tier (./scripts/test.sh -m standard), outside the suite's minutes
    standard_loss_runs: bool = False
    num_frames: int | None = None  # video families: frames per sample (the pipeline's num_frames)
    # the pipeline output's latents, as to_family_latents takes them (video pipelines: `frames`)
    output_latents: Callable[[Any], Any] = lambda output: output.images
    scheduler_steps: int = 1  # scheduler.step calls per denoising step (LTX-2: video, then audio); > 1: tuples
    family_options: dict[str, Any] = field(default_factory=dict)  # get_train_pipeline_config / engine options
    run_args: tuple[str, ...] = ()  # flags of every whole run of this case that give the same options
    sft: bool = True  # sft_loss runs; False: it is refused at start-up
    # guidance scales of the whole-run parity test (the first also checks --save-hf); fewer where other tests or
    # cases already run the same family code the same way
    e2e_guidances: tuple[float, ...] = (1.0, 3.5)
    # editing / image-to-video: source images per prompt (the contract tests draw them) and the pipeline __call__
    # kwargs that pass them (a list per prompt of PIL images in; the pipeline's own argument names out)
    source_images: int = 0
    image_kwargs: Callable[[list[list[Any]]], dict[str, Any]] = lambda images: {"image": [i[0] for i in images]}
    # around the pipeline's __call__, given the folder: what the family reads from a tiny folder that the pipeline
    # hard-codes (Qwen-Image-Edit's reference area)
    call_context: Callable[[str], AbstractContextManager[Any]] = lambda path: contextlib.nullcontext()
    # the pipeline takes one prompt's source images per __call__: it is called per prompt (image_kwargs then gets
    # one prompt's list), its latents and loop steps concatenated along the batch
    per_prompt_calls: bool = False
    # the pipeline reads its guidance from a component rather than a __call__ kwarg (HunyuanVideo 1.5's guider):
    # set it on the loaded pipeline for miles' scale w before each call
    set_pipeline_guidance: Callable[[Any, float], None] = lambda pipe, w: None
    # the pipeline class loads a LoRA adapter (`load_lora_weights`); False: --use-lora --save-hf is refused for it
    loads_lora: bool = True
    # its pipeline runs seconds per forward on a CPU (fixed long sequences): its pipeline-parity cases (fast
    # velocity / ODE, e2e parity) run in the standard tier, outside the suite's minutes
    slow: bool = False
    # its fast contract cases run in the standard tier too, though its forwards are quick: the fast tier's minutes
    # are spent (FLUX.2 [dev], whose code path is klein's but for the text encoder and the embedded guidance)
    standard_contract: bool = False

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
    # test_golden.py runs every loss type on SD3 at dp 2 already; test_policy_loss.py its parity at dp 1 and 2,
    # guidance 1 and 4.5, fp32 and bf16, and test_sft.py loads its --save-hf folder
    FamilyCase(
        "sd3",
        "sd3",
        "tiny_pipeline_dir",
        "StableDiffusion3Pipeline",
        lambda w: {"guidance_scale": w},
        same_layout,
        loss_runs=False,
        e2e_guidances=(),
    ),
    # SD3.5 on the sd3 family; the pipeline's default skip_guidance_layers is None (no skip-layer guidance)
    FamilyCase(
        "sd3.5",
        "sd3",
        "tiny_sd35_dir",
        "StableDiffusion3Pipeline",
        lambda w: {"guidance_scale": w},
        same_layout,
        loss_runs=False,
        e2e_guidances=(1.0,),  # its config's blocks; the sd3 family's CFG runs in test_policy_loss.py
    ),
    # the guidance embedding takes w as an input: one value exercises the path (the fast contract tests check both)
    FamilyCase(
        "flux-dev",
        "flux",
        "tiny_flux_dev_dir",
        "FluxPipeline",
        lambda w: {"guidance_scale": w},
        flux_unpacked,
        e2e_guidances=(1.0,),
    ),
    # the same family code as flux-dev but for guidance, which the parity runs cover
    FamilyCase(
        "flux-schnell",
        "flux",
        "tiny_flux_schnell_dir",
        "FluxPipeline",
        lambda w: {"true_cfg_scale": w, "negative_prompt": "", "guidance_scale": 0.0},
        flux_unpacked,
        loss_runs=False,
        e2e_guidances=(3.5,),  # its true CFG; the conditional forward alone is flux-dev's without the embedding
    ),
    # editing: one source image per prompt. The pipeline would resize it to a preferred Kontext resolution and
    # generate at max_area (default 1024²); miles' loader resizes it to the run's resolution, generated at too
    FamilyCase(
        "flux-kontext",
        "flux-kontext",
        "tiny_flux_kontext_dir",
        "FluxKontextPipeline",
        lambda w: {"guidance_scale": w},
        flux_unpacked,
        call_kwargs={"max_sequence_length": 32, "_auto_resize": False, "max_area": 32 * 32},
        e2e_guidances=(1.0,),  # the guidance embedding takes w as an input, as flux-dev's
        source_images=1,
    ),
    # FLUX.2 [klein]-base: text to image, its true CFG (the pipeline's negative prompt is "") at w > 1
    FamilyCase(
        "flux2-klein",
        "flux2",
        "tiny_flux2_klein_dir",
        "Flux2KleinPipeline",
        lambda w: {"guidance_scale": w},
        flux2_patchified,
        call_kwargs=FLUX2_CALL_KWARGS,
        resolution=64,  # the least the pipeline takes for a reference image, the tiny folder's default
        loss_runs=False,  # the edit case's run the same family code on conditioned samples
        # none: the edit case's parity run (CFG, --save-hf) runs the same code with reference tokens, whose rows
        # without references test_flux2.py checks (measured here at w 1 and 3.5: ratio 1.0, |Δ log-prob| 0.0)
        e2e_guidances=(),
    ),
    # the same folder editing with two reference images per prompt (tokens after the noise's, t = 10 and 20). The
    # pipeline takes one image list for its whole batch: the harness calls it per prompt
    FamilyCase(
        "flux2-klein-edit",
        "flux2",
        "tiny_flux2_klein_dir",
        "Flux2KleinPipeline",
        lambda w: {"guidance_scale": w},
        flux2_patchified,
        call_kwargs=FLUX2_CALL_KWARGS,
        resolution=64,
        standard_loss_runs=True,  # three whole runs: the suite's budget keeps them in the standard tier
        e2e_guidances=(3.5,),  # true CFG with reference tokens; whole runs read builtin:shapes-edit (one per prompt)
        source_images=2,
        image_kwargs=lambda images: {"image": images[0]},  # one prompt's list of PIL images
        per_prompt_calls=True,
    ),
    # FLUX.2 [dev]: the guidance embedding takes w (the pipeline's guidance_scale) at every w, no negative; text to
    # image here, the fast contract tests at w 1 and above
    FamilyCase(
        "flux2-dev",
        "flux2-dev",
        "tiny_flux2_dev_dir",
        "Flux2Pipeline",
        lambda w: {"guidance_scale": w},
        flux2_patchified,
        call_kwargs=FLUX2_DEV_CALL_KWARGS,
        resolution=64,
        loss_runs=False,  # the edit case's run the same family code on conditioned samples
        e2e_guidances=(),  # the edit case's parity run embeds w with reference tokens, the same code
        standard_contract=True,
    ),
    # the same folder editing with two reference images per prompt, called per prompt as klein's edit case
    FamilyCase(
        "flux2-dev-edit",
        "flux2-dev",
        "tiny_flux2_dev_dir",
        "Flux2Pipeline",
        lambda w: {"guidance_scale": w},
        flux2_patchified,
        call_kwargs=FLUX2_DEV_CALL_KWARGS,
        resolution=64,
        standard_loss_runs=True,  # three whole runs: the suite's budget keeps them in the standard tier
        e2e_guidances=(4.0,),  # the pipeline's default embedded guidance, with reference tokens; --save-hf loads
        standard_contract=True,
        source_images=2,
        image_kwargs=lambda images: {"image": images[0]},  # one prompt's list of PIL images
        per_prompt_calls=True,
    ),
    # the pipeline's default max_sequence_length (512) is the family's
    FamilyCase(
        "qwen-image",
        "qwen-image",
        "tiny_qwen_image_dir",
        "QwenImagePipeline",
        lambda w: {"true_cfg_scale": w, **({"negative_prompt": ""} if w > 1 else {})},
        qwen_image_unpacked,
        call_kwargs={},
    ),
    # one source image per prompt; the negative prompt is read with each prompt's image, so the pipeline takes it as
    # a list (a string would be one text for two images); the reference area is the tiny folder's
    FamilyCase(
        "qwen-image-edit",
        "qwen-image-edit",
        "tiny_qwen_image_edit_dir",
        "QwenImageEditPipeline",
        lambda w: {"true_cfg_scale": w, **({"negative_prompt": ["", ""]} if w > 1 else {})},  # the suite's 2 prompts
        qwen_image_unpacked,
        call_kwargs={},
        e2e_guidances=(3.5,),  # true CFG with per-prompt negatives (encoded with each source image) in the trainer
        source_images=1,
        call_context=qwen_edit_reference_area,
    ),
    # Qwen-Image-Edit-Plus (2509): two source images per prompt (it takes one to three), each read by the VL encoder
    # at its condition size and by the VAE at its reference size (the folder's areas), their latents in turn.
    # The pipeline takes one prompt per call. Its loss types are not run again: the loss hooks reach the family only
    # through encode_request / predict_velocity / encode_images / decode_latents, which qwen-image-edit's loss runs
    # drive through the same QwenEditFamily code (predict_velocity, the VAE, true CFG with per-prompt negatives) but
    # for the conditioning's encoding and layout (`encode_prompts`, `reference_tokens`), which the parity run below
    # covers in the trainer at dp 2 (ratio 1, |Δ log-prob| at fp32 rounding) and the fast tests against the pipeline
    FamilyCase(
        "qwen-image-edit-plus",
        "qwen-image-edit-plus",
        "tiny_qwen_image_edit_plus_dir",
        "QwenImageEditPlusPipeline",
        lambda w: {"true_cfg_scale": w, **({"negative_prompt": ""} if w > 1 else {})},  # one prompt per call
        qwen_image_unpacked,
        call_kwargs={},
        loss_runs=False,
        e2e_guidances=(3.5,),  # true CFG with per-prompt negatives read with both images, and --save-hf
        source_images=2,
        image_kwargs=lambda images: {"image": images[0]},  # one prompt's: a list of PIL images
        call_context=qwen_edit_reference_area,
        per_prompt_calls=True,
    ),
    FamilyCase(
        "wan",
        "wan",
        "tiny_wan_dir",
        "WanPipeline",
        lambda w: {"guidance_scale": w},
        same_layout,
        num_frames=5,
        output_latents=lambda output: output.frames,
        family_options={"num_frames": 5},
        run_args=("--num-frames", "5"),
        e2e_guidances=(1.0,),  # Wan's CFG runs in the wan-2-experts case (the same code, both experts)
    ),
    # Wan 2.2 A14B layout: the steps route to both experts, the low-noise one guided by its own scale; its loss
    # types run through the same code as wan's but for the routing, which the parity runs cover
    FamilyCase(
        "wan-2-experts",
        "wan",
        "tiny_wan_2_experts_dir",
        "WanPipeline",
        lambda w: {"guidance_scale": w, "guidance_scale_2": 2.0},
        same_layout,
        loss_runs=False,
        num_frames=5,
        output_latents=lambda output: output.frames,
        family_options={"num_frames": 5, "guidance_scale_2": 2.0},
        run_args=("--num-frames", "5", "--diffusion-guidance-scale-2", "2.0"),
    ),
    # Wan 2.1 I2V layout: one source image per prompt, which WanImageToVideoPipeline takes one at a time (it
    # repeats one image's embeddings and latents over the batch): the harness calls it per prompt
    FamilyCase(
        "wan-i2v",
        "wan-i2v",
        "tiny_wan_i2v_dir",
        "WanImageToVideoPipeline",
        lambda w: {"guidance_scale": w},
        same_layout,
        call_kwargs={},  # the pipeline's 512 text tokens, which its image branch requires
        num_frames=5,
        output_latents=lambda output: output.frames,
        family_options={"num_frames": 5},
        run_args=("--num-frames", "5"),
        e2e_guidances=(3.5,),  # CFG: the negative text with the prompt's image inputs
        source_images=1,
        image_kwargs=lambda images: {"image": images[0][0]},  # one prompt's: the pipeline takes a PIL image
        per_prompt_calls=True,
    ),
    # Wan 2.2 I2V-A14B layout: no image embeddings, the steps route to both experts (guidance_scale_2 on the
    # low-noise one), through the same code as wan-i2v's and wan-2-experts'
    FamilyCase(
        "wan-i2v-2-experts",
        "wan-i2v",
        "tiny_wan_i2v_2_experts_dir",
        "WanImageToVideoPipeline",
        lambda w: {"guidance_scale": w, "guidance_scale_2": 2.0},
        same_layout,
        call_kwargs={},
        loss_runs=False,
        num_frames=5,
        output_latents=lambda output: output.frames,
        family_options={"num_frames": 5, "guidance_scale_2": 2.0},
        run_args=("--num-frames", "5", "--diffusion-guidance-scale-2", "2.0"),
        e2e_guidances=(1.0,),  # the image inputs routed row by row to both experts
        source_images=1,
        image_kwargs=lambda images: {"image": images[0][0]},
        per_prompt_calls=True,
    ),
    # text-to-video with the guider as a component: its scale is set on the pipeline (w = 1: its CFG is off)
    FamilyCase(
        "hunyuan-video15",
        "hunyuan-video15",
        "tiny_hunyuan_video15_dir",
        "HunyuanVideo15Pipeline",
        lambda w: {},
        same_layout,
        call_kwargs={},  # the pipeline's fixed text lengths (1000 Qwen, 256 ByT5 tokens)
        loss_runs=False,
        num_frames=5,
        output_latents=lambda output: output.frames,
        family_options={"num_frames": 5},
        run_args=("--num-frames", "5"),
        e2e_guidances=(1.0,),
        set_pipeline_guidance=lambda pipe, w: setattr(pipe, "guider", pipe.guider.new(guidance_scale=w)),
        loads_lora=False,
        slow=True,
    ),
    # the pipeline's guidance_scale g is miles' w - 1 (its cond + g * (cond - uncond)); its 512 text tokens. Its CFG
    # runs in the trainer in z-image-cfg-options' parity run (the same code, with the options); its loss-type runs
    # (nft, dmd2, sft_loss: 3-80 s each here, dmd2 starting a critic group) are in the standard tier
    FamilyCase(
        "z-image",
        "z-image",
        "tiny_z_image_dir",
        "ZImagePipeline",
        lambda w: {"guidance_scale": w - 1.0},
        same_layout,
        call_kwargs={},
        e2e_guidances=(1.0,),
        standard_loss_runs=True,
    ),
    # the pipeline's CFG options: renormalization to the conditional norm, and no CFG on the steps whose 1 - σ
    # exceeds 0.2 (on the 32 px grids: the second of 2 steps, the last two of 4). The parity run trains steps 1 and
    # 2 of 4 (--diffusion-sde-window-range), one guided and one not, so the trainer's rows mix both
    FamilyCase(
        "z-image-cfg-options",
        "z-image",
        "tiny_z_image_dir",
        "ZImagePipeline",
        lambda w: {"guidance_scale": w - 1.0, "cfg_normalization": 1.0, "cfg_truncation": 0.2},
        same_layout,
        call_kwargs={},
        loss_runs=False,
        family_options={"cfg_normalization": 1.0, "cfg_truncation": 0.2},
        run_args=(
            "--z-image-cfg-normalization",
            "1.0",
            "--z-image-cfg-truncation",
            "0.2",
            "--diffusion-sde-window-range",
            "1,3",
        ),
        e2e_guidances=(3.5,),
    ),
    # joint audio-video latents; the pipeline run without STG and modality guidance (which miles does not run)
    FamilyCase(
        "ltx2",
        "ltx2",
        "tiny_ltx2_dir",
        "LTX2Pipeline",
        lambda w: {
            "guidance_scale": w,
            "audio_guidance_scale": w,
            "stg_scale": 0.0,
            "audio_stg_scale": 0.0,
            "modality_scale": 1.0,
            "audio_modality_scale": 1.0,
            "spatio_temporal_guidance_blocks": None,
        },
        ltx2_joint,
        num_frames=121,
        output_latents=lambda output: (output.frames, output.audio),
        scheduler_steps=2,
        sft=False,
    ),
]


def case_params(cases: list[FamilyCase]) -> list[Any]:
    """`cases` as pytest params, a `slow` or `standard_contract` case's marked `standard` (run by
    ./scripts/test.sh -m standard)."""
    standard = [case.slow or case.standard_contract for case in cases]
    return [pytest.param(case, marks=pytest.mark.standard) if s else case for case, s in zip(cases, standard)]
