"""The Stable Diffusion 3 family: SD3Transformer2DModel, CLIP x2 + T5 text encoders, AutoencoderKL, flow matching.

Everything is computed exactly as `diffusers.StableDiffusion3Pipeline` does, from a local pipeline folder.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
from huggingface_hub import save_torch_state_dict
from safetensors import safe_open
from torch import nn

from miles.models.base import (
    DTYPE_KW,
    SAFETENSORS_DTYPES,
    TrainPipelineConfig,
    compute_dtype,
    load_pretrained,
    register_train_pipeline_config,
    strip_name_or_path,
)
from miles.models.conditioning import Conditioning
from miles.models.media import Media

logger = logging.getLogger(__name__)

_WEIGHTS_NAME = "diffusion_pytorch_model{suffix}.safetensors"
_SD3_DEFAULT_T5_LENGTH = 256  # StableDiffusion3Pipeline's default max_sequence_length
# diffusers renamed from_pretrained's `torch_dtype` to `dtype` (0.36+) and warns on the old name


@register_train_pipeline_config
class SD3PipelineConfig(TrainPipelineConfig):
    """SD3 / SD3.5 pipeline folders (`StableDiffusion3Pipeline`)."""

    name = "sd3"
    pipeline_class_name = "StableDiffusion3Pipeline"
    # joint attention of SD3's JointTransformerBlock: image-stream and context-stream projections
    default_lora_targets = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
    transformer_class: type[nn.Module] = SD3Transformer2DModel  # what load_transformer builds
    text_pipeline_class: type = StableDiffusion3Pipeline  # what load_text_encoders builds (tokenizers + encoders)

    # networks
    def load_transformer(
        self, path: str | None = None, dtype: torch.dtype = torch.float32, *, empty: bool = False
    ) -> nn.Module:
        """The transformer from a pipeline folder (its `transformer/`) or a folder with config.json at the top;
        `empty`: built on the meta device, no weights read (`load_pretrained`)."""
        root = Path(path or self.path)
        if (root / "transformer" / "config.json").is_file():
            subfolder = "transformer"
        elif (root / "config.json").is_file():
            subfolder = None
        else:
            raise FileNotFoundError(
                f"{root} holds neither transformer/config.json nor config.json (a {self.transformer_class.__name__})"
            )
        return load_pretrained(self.transformer_class, root, subfolder, dtype, empty=empty)

    def transformer_blocks(self, transformer: nn.Module) -> list[nn.Module]:
        """The joint blocks FSDP shards one by one."""
        return list(transformer.transformer_blocks)

    def save_transformer(
        self, transformer_state_dict: dict[str, torch.Tensor], out_dir: str, dtype: torch.dtype | None = None
    ) -> str:
        """Write a full pipeline folder: this folder's other components plus the given transformer weights.

        Weights are stored in `dtype`, by default each tensor's dtype in the source checkpoint. Returns `out_dir`.
        """
        src, out = Path(self.path).resolve(), Path(out_dir).resolve()
        if out == src:
            raise ValueError(f"save_transformer would overwrite its own source pipeline {src}; pick another out_dir")
        source_dtypes = self._checkpoint_dtypes()
        missing = sorted(set(source_dtypes) - set(transformer_state_dict))
        unexpected = sorted(set(transformer_state_dict) - set(source_dtypes))
        if missing or unexpected:
            raise ValueError(
                f"transformer state dict does not match {src / 'transformer'}: "
                f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
            )
        shutil.copytree(src, out, ignore=shutil.ignore_patterns("transformer"), dirs_exist_ok=True)
        strip_name_or_path(out)  # the source's components may name the folder they were built in
        if (out / "transformer").exists():
            shutil.rmtree(out / "transformer")  # stale shards of an earlier save would be picked up
        (out / "transformer").mkdir(parents=True)
        shutil.copy2(src / "transformer" / "config.json", out / "transformer" / "config.json")
        state = {
            k: _owning(v.detach().to(device="cpu", dtype=dtype or source_dtypes[k]).contiguous())
            for k, v in transformer_state_dict.items()
        }
        save_torch_state_dict(state, str(out / "transformer"), filename_pattern=_WEIGHTS_NAME)
        for file in (out / "transformer").iterdir():
            file.chmod(0o644)  # the hub writer creates files 0600; keep them readable like the copied components
        logger.info("saved %s pipeline with new transformer weights to %s", self.name, out)
        return str(out)

    def _checkpoint_dtypes(self) -> dict[str, torch.dtype]:
        folder = Path(self.path, "transformer")
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{folder} has no .safetensors weights")
        dtypes: dict[str, torch.dtype] = {}
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    dtypes[key] = f.get_slice(key).get_dtype()
        return {k: SAFETENSORS_DTYPES[v] for k, v in dtypes.items()}

    # text
    def load_text_encoders(self, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> Any:
        """The family's pipeline holding only the tokenizers and text encoders (eval mode), cached."""
        return self.load_text_pipeline(
            self.text_pipeline_class,
            without=("transformer", "vae"),
            frozen=("text_encoder", "text_encoder_2", "text_encoder_3"),
            device=device,
            dtype=dtype,
        )

    @property
    def max_sequence_length(self) -> int:
        """T5 tokens per prompt: the T5 tokenizer's limit, at most the SD3 pipeline default (256)."""
        return self.tokenizer_limit("tokenizer_3", _SD3_DEFAULT_T5_LENGTH)

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], device: torch.device | str | None = None) -> Conditioning:
        """CLIP-L, CLIP-G and T5 embeddings as `StableDiffusion3Pipeline.encode_prompt(max_sequence_length=...)`.

        `prompt_embeds` (B, L, D): 77 CLIP tokens (both CLIPs side by side, zero-padded to the T5 width) then the T5
        tokens; `pooled_prompt_embeds` (B, P): both CLIPs' pooled outputs.
        Loads the text encoders (CPU, float32) on first use unless `load_text_encoders` ran; `device` moves the result.
        """
        if not prompts:
            raise ValueError("encode_prompts needs at least one prompt")
        pipe = self.text_pipeline()
        prompt_embeds, _, pooled, _ = pipe.encode_prompt(
            prompt=list(prompts),
            prompt_2=None,
            prompt_3=None,
            device=pipe.text_encoder.device,  # computed where the encoders live, then moved
            num_images_per_prompt=1,
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
        )
        return Conditioning({"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled}).to(device=device)

    # media
    def load_vae(self, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> AutoencoderKL:
        """The VAE in eval mode, cached."""
        vae = AutoencoderKL.from_pretrained(self.path, subfolder="vae", **{DTYPE_KW: dtype}, local_files_only=True)
        vae = vae.to(device).eval().requires_grad_(False)
        self._loaded["vae"] = vae
        return vae

    def _vae(self) -> AutoencoderKL:
        return self._loaded["vae"] if "vae" in self._loaded else self.load_vae()

    def _vae_normalization(self, vae: AutoencoderKL) -> tuple[float, float]:
        return float(vae.config.shift_factor or 0.0), float(vae.config.scaling_factor)

    @torch.no_grad()
    def encode_images(self, images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Normalized latents x0 = (z - shift_factor) * scaling_factor of images (B, 3, H, W) in [-1, 1].

        z is the posterior mode without a generator, a posterior sample drawn with it otherwise. float32.
        """
        vae = self._vae()
        posterior = vae.encode(images.to(device=vae.device, dtype=vae.dtype)).latent_dist
        z = posterior.mode() if generator is None else posterior.sample(generator=generator)
        shift, scale = self._vae_normalization(vae)
        return ((z - shift) * scale).float()

    @torch.no_grad()
    def decode_latents(self, x0: torch.Tensor) -> Media:
        """Images (B, 3, H, W) in [0, 1], float32, from normalized latents (the inverse of encode_images)."""
        vae = self._vae()
        shift, scale = self._vae_normalization(vae)
        z = x0.to(device=vae.device, dtype=vae.dtype) / scale + shift
        images = vae.decode(z, return_dict=False)[0]
        return Media((images.float() / 2 + 0.5).clamp(0, 1))

    # the flow
    def predict_velocity(
        self,
        transformer: nn.Module,
        latents: torch.Tensor,
        sigmas: torch.Tensor,
        embeds: Conditioning,
        *,
        guidance_scale: float = 1.0,
        negative: Conditioning | None = None,
    ) -> torch.Tensor:
        """The network's velocity at noise levels `sigmas` (B,), timestep 1000 * sigma, float32, latents' shape.

        With guidance_scale > 1: one batched forward of [negative; positive], then uncond + w * (cond - uncond),
        as StableDiffusion3Pipeline does. `negative` may be a batch of one (broadcast).
        """
        batch = latents.shape[0]
        if sigmas.shape != (batch,):
            raise ValueError(f"sigmas must have shape ({batch},), got {tuple(sigmas.shape)}")
        if embeds.batch_size != batch:
            raise ValueError(f"embeds batch {embeds.batch_size} != latents batch {batch}")
        dtype = compute_dtype(transformer)  # the timestep stays fp32, as in StableDiffusion3Pipeline
        timestep = sigmas.to(device=latents.device, dtype=torch.float32) * 1000.0
        hidden, cond = latents, embeds
        guided = guidance_scale > 1.0
        if guided:
            if negative is None:
                raise ValueError("guidance_scale > 1 needs negative embeddings (see encode_negative)")
            cond = Conditioning.cat([negative.expand(batch), embeds])
            hidden, timestep = torch.cat([latents, latents]), torch.cat([timestep, timestep])
        cond = cond.to(device=latents.device, dtype=dtype)
        pred = transformer(
            hidden_states=hidden.to(dtype),
            timestep=timestep,
            encoder_hidden_states=cond["prompt_embeds"],
            pooled_projections=cond["pooled_prompt_embeds"],
            return_dict=False,
        )[0].float()
        if not guided:
            return pred
        uncond, text = pred.chunk(2)
        return uncond + guidance_scale * (text - uncond)

    def load_scheduler(self) -> FlowMatchEulerDiscreteScheduler:
        """The folder's flow-matching scheduler (sigmas and shift as the pipeline uses them)."""
        return FlowMatchEulerDiscreteScheduler.from_pretrained(self.path, subfolder="scheduler", local_files_only=True)

    # geometry
    @property
    def scheduler_shift(self) -> float:
        return float(self.read_json("scheduler", "scheduler_config.json").get("shift", 1.0))

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.read_json("vae", "config.json")["block_out_channels"]) - 1)

    @property
    def patch_size(self) -> int:
        return int(self.read_json("transformer", "config.json").get("patch_size", 2))

    @property
    def default_resolution(self) -> int:
        return int(self.read_json("transformer", "config.json")["sample_size"]) * self.vae_scale_factor

    def latent_shape(self, resolution: int | None = None) -> tuple[int, int, int]:
        """(channels, h, w) of the latents of a square image; resolution defaults to `default_resolution`."""
        resolution = resolution or self.default_resolution
        multiple = self.vae_scale_factor * self.patch_size
        if resolution % multiple != 0:
            raise ValueError(f"resolution {resolution} must be a multiple of {multiple} (VAE factor x patch size)")
        channels = int(self.read_json("vae", "config.json")["latent_channels"])
        side = resolution // self.vae_scale_factor
        return channels, side, side


def _owning(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, copied when it is a view into a larger storage: a gathered FSDP2 parameter whose first dimension
    the shards padded is one (e.g. LTX-2's (5, D) scale-shift tables at dp 2), and safetensors refuses to save it."""
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        return tensor.clone()
    return tensor
