"""`DiffusersFamily`, the neutral base of the built-in families (ARCHITECTURE §12): what every family does with a
diffusers pipeline folder (its components, `--save-hf`, the text pipeline, the VAE, cached configs), and the VAE
scaling and σ-grid helpers several families' pipelines share. No family's own maths (guidance, packing) lives here."""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import numpy as np
import torch
from diffusers.models.modeling_utils import ModelMixin
from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler
from huggingface_hub import save_torch_state_dict
from safetensors import safe_open
from torch import nn

from miles.models.base import TrainPipelineConfig, load_pretrained
from miles.models.conditioning import Conditioning
from miles.models.loading.pretrained import SAFETENSORS_DTYPES, moved_to, strip_name_or_path
from miles.models.media import Media

logger = logging.getLogger(__name__)

WEIGHTS_NAME = "diffusion_pytorch_model{suffix}.safetensors"  # diffusers' safetensors shards of a model folder
# run defaults a folder suggests (`resolution`, `num_frames`): the tiny folders' toy sizes; diffusers ignores the file
RUN_DEFAULTS_FILE = "miles_defaults.json"
M = TypeVar("M", bound=ModelMixin)


def diffusers_class(value: type | str) -> type:
    """A family's class attribute as a class: itself, or the `diffusers` attribute it names (imported now)."""
    if not isinstance(value, str):
        return value
    import diffusers

    return getattr(diffusers, value)


def diffusers_model_class(value: type[ModelMixin] | str) -> type[ModelMixin]:
    """`diffusers_class` of a network's class attribute (`vae_class`), which is a diffusers model class."""
    cls = diffusers_class(value)
    if not issubclass(cls, ModelMixin):
        raise TypeError(f"{value!r} is not a diffusers model class (a ModelMixin), which a family's networks are")
    return cls


class DiffusersFamily(TrainPipelineConfig):
    """A family whose folder is a diffusers pipeline: a transformer in `transformer/`, text encoders its pipeline class
    encodes prompts with, a VAE in `vae/`. A subclass declares the classes and names below and its own maths."""

    transformer_class: ClassVar[type[ModelMixin]]  # what load_transformer builds
    # the pipeline whose encode_prompt load_text_encoders keeps, and what load_vae builds from `vae/`: a class or its
    # name in `diffusers` (a name is imported on first use: a trainer rank, which loads neither, skips importing
    # the pipeline, its text-encoder classes and every diffusers VAE, about 1 s per process)
    text_pipeline_class: ClassVar[type | str]
    vae_class: ClassVar[type[ModelMixin] | str]
    # the pipeline components the text pipeline leaves out, and its text modules (eval mode, no gradients)
    non_text_components: ClassVar[tuple[str, ...]] = ("transformer", "vae")
    text_modules: ClassVar[tuple[str, ...]] = ("text_encoder",)

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
        """The blocks FSDP shards one by one: diffusers' `transformer_blocks`."""
        return child_blocks(transformer, "transformer_blocks")

    def save_transformer(
        self, transformer_state_dict: dict[str, torch.Tensor], out_dir: str, dtype: torch.dtype | None = None
    ) -> str:
        """A full pipeline folder: this folder's other components plus the given transformer weights, stored in
        `dtype`, by default each tensor's dtype in the source checkpoint. Returns `out_dir`."""
        return self.save_pipeline({"transformer": transformer_state_dict}, out_dir, dtype)

    def saved_transformer_dtypes(self) -> dict[str, torch.dtype]:
        """Each transformer entry's dtype in the source checkpoint, which `save_transformer` stores it in."""
        return self.checkpoint_dtypes(Path(self.path) / "transformer")

    def save_pipeline(
        self, states: dict[str, dict[str, torch.Tensor]], out_dir: str, dtype: torch.dtype | None = None
    ) -> str:
        """This folder copied to `out_dir` with new weights in each subfolder of `states` (subfolder -> state dict,
        which must hold exactly the source subfolder's keys). Returns `out_dir`."""
        src, out = Path(self.path).resolve(), Path(out_dir).resolve()
        if out == src:
            raise ValueError(f"save_transformer would overwrite its own source pipeline {src}; pick another out_dir")
        source_dtypes = {sub: self.checkpoint_dtypes(src / sub) for sub in states}
        for sub, state in states.items():
            missing = sorted(set(source_dtypes[sub]) - set(state))
            unexpected = sorted(set(state) - set(source_dtypes[sub]))
            if missing or unexpected:
                raise ValueError(
                    f"transformer state dict does not match {src / sub}: "
                    f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                    f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
                )
        shutil.copytree(src, out, ignore=shutil.ignore_patterns(*states), dirs_exist_ok=True)
        strip_name_or_path(out)  # the source's components may name the folder they were built in
        for sub, state in states.items():
            if (out / sub).exists():
                shutil.rmtree(out / sub)  # stale shards of an earlier save would be picked up
            (out / sub).mkdir(parents=True)
            shutil.copy2(src / sub / "config.json", out / sub / "config.json")
            tensors = {k: own_storage(v.detach().to(device="cpu", dtype=dtype or source_dtypes[sub][k]).contiguous())
                       for k, v in state.items()}  # fmt: skip
            save_torch_state_dict(tensors, str(out / sub), filename_pattern=WEIGHTS_NAME)
            for file in (out / sub).iterdir():
                file.chmod(0o644)  # the hub writer creates files 0600; keep them readable like the copied components
        logger.info("saved %s pipeline with new transformer weights (%s) to %s", self.name, ", ".join(states), out)
        return str(out)

    @staticmethod
    def checkpoint_dtypes(folder: Path) -> dict[str, torch.dtype]:
        """Each tensor's dtype in the safetensors of a model folder."""
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{folder} has no .safetensors weights")
        dtypes: dict[str, torch.dtype] = {}
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    dtypes[key] = SAFETENSORS_DTYPES[f.get_slice(key).get_dtype()]
        return dtypes

    # text
    def load_text_encoders(self, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> Any:
        """`text_pipeline_class` holding only the tokenizers and text modules (eval mode), cached."""
        return self.load_text_pipeline(
            diffusers_class(self.text_pipeline_class),
            without=self.non_text_components,
            frozen=self.text_modules,
            device=device,
            dtype=dtype,
        )

    # media
    def load_vae(self, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> ModelMixin:
        """The VAE (`vae_class` from `vae/`) in eval mode, cached; decoding in tiles with `--vae-tiling on`."""
        vae = load_pretrained(diffusers_model_class(self.vae_class), self.path, "vae", dtype)
        vae = tiled_if_asked(moved_to(vae, device).eval().requires_grad_(False), self.family_options)
        self._loaded["vae"] = vae
        return vae

    def cached_vae(self) -> ModelMixin:
        """The VAE load_vae loaded; on first use loaded on the CPU in float32."""
        vae: ModelMixin = self._loaded["vae"] if "vae" in self._loaded else self.load_vae()
        return vae

    # configs
    def cached_json(self, *parts: str) -> dict[str, Any]:
        """`read_json(*parts)`, read once (the sampling loop asks at every step)."""
        key = ("json", *parts)
        if key not in self._loaded:
            self._loaded[key] = self.read_json(*parts)
        return self._loaded[key]

    def scheduler_config(self) -> dict[str, Any]:
        return self.cached_json("scheduler", "scheduler_config.json")

    def folder_default(self, key: str) -> Any:
        """The run default `key` the folder suggests in its RUN_DEFAULTS_FILE, or None (real pipeline folders have
        none: their pipeline's defaults apply)."""
        if not Path(self.path, RUN_DEFAULTS_FILE).is_file():
            return None
        return self.cached_json(RUN_DEFAULTS_FILE).get(key)


def child_blocks(module: nn.Module, *names: str) -> list[nn.Module]:
    """The modules of each of `module`'s block lists `names` (dotted paths to `nn.ModuleList`s), in order."""
    return [block for name in names for block in module.get_submodule(name).children()]


def write_run_defaults(folder: str | Path, **defaults: Any) -> None:
    """Record the run defaults of a pipeline folder (`DiffusersFamily.folder_default`), e.g. a tiny folder's sizes."""
    Path(folder, RUN_DEFAULTS_FILE).write_text(json.dumps(defaults, indent=2, sort_keys=True) + "\n")


def own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, copied when it is a view into a larger storage: a gathered FSDP2 parameter whose first dimension
    the shards padded is one (e.g. LTX-2's (5, D) scale-shift tables at dp 2), and safetensors refuses to save it."""
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        return tensor.clone()
    return tensor


def check_velocity_inputs(latents: torch.Tensor, sigmas: torch.Tensor, embeds: Conditioning) -> None:
    """What every `predict_velocity` needs: one σ and one conditioning row per latent."""
    batch = latents.shape[0]
    if sigmas.shape != (batch,):
        raise ValueError(f"sigmas must have shape ({batch},), got {tuple(sigmas.shape)}")
    if embeds.batch_size != batch:
        raise ValueError(f"embeds batch {embeds.batch_size} != latents batch {batch}")


def square_latent_side(resolution: int, vae_scale_factor: int, multiple: int, why: str) -> int:
    """Latents per side of a square frame of `resolution` pixels, which must be a multiple of `multiple` (`why`)."""
    if resolution % multiple != 0:
        raise ValueError(f"resolution {resolution} must be a multiple of {multiple} ({why})")
    return resolution // vae_scale_factor


# VAE scaling
def posterior_latents(vae: ModelMixin, pixels: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """The VAE posterior of `pixels` (on the VAE's device and dtype): its mode without a generator, a sample drawn
    from `generator` otherwise."""
    posterior = vae.encode(pixels).latent_dist
    return posterior.mode() if generator is None else posterior.sample(generator=generator)


def unit_range(pixels: torch.Tensor) -> torch.Tensor:
    """A VAE's decoded pixels in [-1, 1] as float32 in [0, 1] (diffusers' image and video processors)."""
    return (pixels.float() / 2 + 0.5).clamp(0, 1)


def shift_and_scale(vae: ModelMixin) -> tuple[float, float]:
    """AutoencoderKL's normalization: latents x0 = (z - shift_factor) * scaling_factor."""
    return float(vae.config.shift_factor or 0.0), float(vae.config.scaling_factor)


def encode_shift_scaled(vae: ModelMixin, images: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Normalized latents (z - shift_factor) * scaling_factor (float32) of images (B, 3, H, W) in [-1, 1]."""
    z = posterior_latents(vae, images.to(device=vae.device, dtype=vae.dtype), generator)
    shift, scale = shift_and_scale(vae)
    return ((z - shift) * scale).float()


def decode_shift_scaled(vae: ModelMixin, x0: torch.Tensor) -> Media:
    """Images (B, 3, H, W) in [0, 1], float32, of normalized latents (the inverse of `encode_shift_scaled`)."""
    shift, scale = shift_and_scale(vae)
    z = x0.to(device=vae.device, dtype=vae.dtype) / scale + shift
    return Media(unit_range(vae.decode(z, return_dict=False)[0]))


def channel_stats(vae: ModelMixin, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The config's per-channel `latents_mean` and `latents_std` as (1, C, 1, 1, 1) tensors on `like`'s device and
    dtype (video VAEs: AutoencoderKLWan, AutoencoderKLQwenImage)."""
    channels = vae.config.z_dim
    mean = torch.tensor(vae.config.latents_mean).view(1, channels, 1, 1, 1).to(like.device, like.dtype)
    std = torch.tensor(vae.config.latents_std).view(1, channels, 1, 1, 1).to(like.device, like.dtype)
    return mean, std


# σ grids
def training_shift(scheduler_config: dict[str, Any]) -> float:
    """The static shift of a flow-matching scheduler's training σ table: 1 under dynamic shifting (the table is
    unshifted, as diffusers' training scripts see it), the config's `shift` otherwise."""
    if scheduler_config.get("use_dynamic_shifting", False):
        return 1.0
    return float(scheduler_config.get("shift", 1.0))


def dynamic_sampling_shift(scheduler_config: dict[str, Any], mu: float) -> float:
    """The static shift s whose map σ = s·t/(1 + (s − 1)·t) is what `dynamic_shift_sigmas` applies to the unshifted
    t = linspace(1, 1/N, N): diffusers' time shift with exponent 1 is that map with s = e^μ (`time_shift_type`
    "exponential", FLUX.1's) or s = μ ("linear"); without dynamic shifting the config's `shift` (FLUX.1-schnell:
    1). A `shift_terminal` stretch after it (Qwen-Image, LTX-2: an affine map of σ) is not part of it."""
    if not scheduler_config.get("use_dynamic_shifting", False):
        return float(scheduler_config.get("shift", 1.0))
    kind = scheduler_config.get("time_shift_type", "exponential")
    if kind not in ("exponential", "linear"):
        raise ValueError(f"scheduler time_shift_type {kind!r} is not one diffusers defines (exponential, linear)")
    return math.exp(mu) if kind == "exponential" else float(mu)


def calculate_shift_args(scheduler_config: dict[str, Any]) -> tuple[int, int, float, float]:
    """The arguments after the token count of the FLUX.1 and Qwen-Image pipelines' `calculate_shift` (mu of the
    resolution): the config's base_image_seq_len, max_image_seq_len, base_shift and max_shift, with their defaults."""
    return (
        scheduler_config.get("base_image_seq_len", 256),
        scheduler_config.get("max_image_seq_len", 4096),
        scheduler_config.get("base_shift", 0.5),
        scheduler_config.get("max_shift", 1.15),
    )


def dynamic_shift_sigmas(scheduler_config: dict[str, Any], num_steps: int, mu: float) -> torch.Tensor:
    """The grid of pipelines that shift by resolution: σ = linspace(1, 1/N, N) through the folder's flow-matching
    scheduler with `mu`, then 0 (float32, N + 1 values)."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(scheduler_config)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)
    return scheduler.sigmas.detach().to(torch.float32).cpu().clone()


def tiled_if_asked(vae: M, options: dict[str, Any]) -> M:
    """`vae` decoding in overlapping spatial tiles, blended (diffusers' `enable_tiling()`), when the family's
    `--vae-tiling` says on (`VAE_TILING_FAMILIES`)."""
    if options.get("vae_tiling") == "on":
        vae.enable_tiling()
    return vae
