"""The LTX-2 family: LTX2VideoTransformer3DModel denoising joint video and audio latents, Gemma 3 conditioning through
the pipeline's text connectors, the video VAE, the audio VAE and the vocoder. Computed as `diffusers.LTX2Pipeline`
does (text to video with sound), from a local pipeline folder.

One joint latent per sample. The pipeline denoises two latents side by side, a video latent (C, F, H, W) and an
audio latent (C_a, L, M) (L audio latent frames of M mel bins), both normalized, stepped by two copies of one
scheduler on the same σ grid (the `mu` shift of the video token count) with the same transformer forward. miles
holds them as one flat vector per sample, `latent_shape() == (D_video + D_audio,)`: the video latent flattened
then the audio latent flattened. `predict_velocity` splits it, packs both streams into the pipeline's token layouts,
runs the transformer once (twice under CFG, batched) and joins the two velocities; the noise of a sample is drawn
as the pipeline draws it (the video latent, then the audio latent, from the sample's generator: `draw_noise`).
The engine, the SDE kernels, the losses and the trainer see one latent, so the per-step log-prob of a sample covers
both streams (docs/user-guide/customization.md, "LTX-2 notes").

Guidance is the pipeline's default path without its extra forwards: CFG in x0 space (delta form) with the same
scale for both streams, then guidance rescale (the pipeline's default 0.7, per stream); spatio-temporal guidance
(STG) and modality-isolation guidance are not run (the pipeline with `stg_scale=0, modality_scale=1`).
"""

from __future__ import annotations

import argparse
import logging
import math
from typing import Any, ClassVar

import torch
from diffusers.models import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, LTX2VideoTransformer3DModel, ModelMixin
from diffusers.models.autoencoders.autoencoder_kl_ltx2_audio import LATENT_DOWNSAMPLE_FACTOR
from diffusers.pipelines.flux.pipeline_flux import calculate_shift
from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder, LTX2VocoderWithBWE
from torch import nn

from miles.models.base import RunAlgorithm, compute_dtype, load_pretrained, moved_to, register_train_pipeline_config
from miles.models.conditioning import Conditioning
from miles.models.diffusers_family import (
    DiffusersFamily,
    check_velocity_inputs,
    dynamic_sampling_shift,
    dynamic_shift_sigmas,
    tiled_if_asked,
    training_shift,
)
from miles.models.ltx2.sequence_parallel import shard_ltx2_sequence
from miles.models.ltx2.streams import (
    guided_stream_velocity,
    joint_forward,
    pack_audio,
    pack_video,
    unpack_audio,
    unpack_video,
    vae_factors,
)
from miles.models.media import Media
from miles.models.options import options_of
from miles.models.sequence_parallel import SequenceParallelGroup, sequence_parallel_problems

logger = logging.getLogger(__name__)

LTX2_DEFAULT_NUM_FRAMES = 121  # LTX2Pipeline's num_frames default (checkpoints without a duration head)
LTX2_DEFAULT_FRAME_RATE = 24.0  # its frame_rate default
LTX2_DEFAULT_RESOLUTION = 512  # its default height (its default frame is 512x768; miles samples square frames)
_LTX2_MAX_SEQUENCE_LENGTH = 1024  # its max_sequence_length default


@register_train_pipeline_config
class LTX2PipelineConfig(DiffusersFamily):
    """LTX-2 pipeline folders (`LTX2Pipeline`): text to video with sound, square frames.

    `num_frames` (default the folder's `folder_default`, else the pipeline's 121) must be 1 + a multiple of the VAE's
    temporal factor; the frame rate is the pipeline's default 24 fps (it sets the video positions the transformer
    sees and the audio length).
    The text pipeline keeps the tokenizer, the Gemma text encoder and the text connectors.
    """

    name = "ltx2"
    prompt_cache_exact = True  # Gemma at a fixed length
    pipeline_class_name = "LTX2Pipeline"
    options = options_of("ltx2")
    # the attention projections of every attention of a block: video and audio self- and text cross-attention and
    # the audio-to-video / video-to-audio cross-attention
    default_lora_targets = ("to_q", "to_k", "to_v", "to_out.0")
    transformer_class = LTX2VideoTransformer3DModel
    text_pipeline_class = "LTX2Pipeline"
    non_text_components = ("transformer", "vae", "audio_vae", "vocoder")
    text_modules = ("text_encoder", "connectors")
    vae_class: ClassVar[type[AutoencoderKLLTX2Video]] = AutoencoderKLLTX2Video
    supports_sequence_parallel = True  # Ulysses over --sp-size ranks (miles.models.ltx2.sequence_parallel)

    def __init__(self, path: str, **options: Any) -> None:
        super().__init__(path, **options)
        frames = self.family_options.get("num_frames") or self.folder_default("num_frames")
        self.num_frames = int(frames or LTX2_DEFAULT_NUM_FRAMES)
        self.frame_rate = LTX2_DEFAULT_FRAME_RATE
        temporal = self.vae_scale_factor_temporal
        if self.num_frames < 1 or (self.num_frames - 1) % temporal:
            raise ValueError(
                f"num_frames {self.num_frames}: LTX-2 needs num_frames - 1 divisible by the video VAE's temporal "
                f"factor {temporal} (e.g. {LTX2_DEFAULT_NUM_FRAMES})"
            )

    def check_run_args(self, args: argparse.Namespace, algorithm: RunAlgorithm) -> None:
        """Training on (prompt, image) dataset records is refused at start-up (a run without engines, --train-only):
        the LTX-2 latent is a joint video + audio latent that no image encodes."""
        if args.train_only or not algorithm.uses_engines:
            raise ValueError(
                f"--loss-type {args.loss_type} trains on (prompt, image) dataset records (--train-only), which is not "
                f"supported for the {self.name} family ({self.path}): its latent is a joint video + audio latent and "
                "miles has no dataset path of (prompt, video, audio) records; train it with an algorithm whose "
                "rollouts are generated (policy_loss, nft, dmd2 or a custom loss)"
            )

    # networks: `DiffusersFamily`'s (the audio-video blocks are its `transformer_blocks`)
    def sequence_parallel_problems(self, sp_size: int, resolution: int | None = None) -> list[str]:
        """--sp-size must divide the video attention heads (video self- and text cross-attention), the audio ones
        (audio self- and text cross-attention, both audio-video cross-attentions), and the video and the audio tokens
        per sample at `resolution` and `num_frames`."""
        if sp_size == 1:
            return []
        config = self.read_json("transformer", "config.json")
        (_, frames, height, width), (_, audio_frames, _) = self.stream_shapes(resolution)
        patch, patch_t = self.transformer_patch_sizes
        return sequence_parallel_problems(
            self.name,
            sp_size,
            heads={
                "video": int(config.get("num_attention_heads", 32)),
                "audio": int(config.get("audio_num_attention_heads", 32)),
            },
            tokens={"video": (frames // patch_t) * (height // patch) * (width // patch), "audio": audio_frames},
        )

    def apply_sequence_parallel(self, transformer: nn.Module, sp: SequenceParallelGroup) -> None:
        """The video and the audio tokens split over the ranks of `sp` (`shard_ltx2_sequence`)."""
        shard_ltx2_sequence(transformer, sp)

    # text
    @property
    def max_sequence_length(self) -> int:
        """Gemma tokens per prompt: the tokenizer's limit, at most LTX2Pipeline's default (1024)."""
        return self.tokenizer_limit("tokenizer", _LTX2_MAX_SEQUENCE_LENGTH)

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], device: torch.device | str | None = None) -> Conditioning:
        """`LTX2Pipeline.encode_prompt` (every Gemma hidden state, left-padded to `max_sequence_length`) through the
        pipeline's text connectors: `prompt_embeds` (B, L, D) the video stream's text, `audio_prompt_embeds`
        (B, L, D_a) the audio stream's, `attention_mask` (B, L) the connectors' binary mask (int64)."""
        if not prompts:
            raise ValueError("encode_prompts needs at least one prompt")
        pipe = self.text_pipeline()
        embeds, mask, _, _ = pipe.encode_prompt(
            prompt=list(prompts),
            do_classifier_free_guidance=False,
            num_videos_per_prompt=1,
            max_sequence_length=self.max_sequence_length,
            device=pipe.text_encoder.device,
        )
        padding_side = getattr(pipe.tokenizer, "padding_side", "left")
        video, audio, mask = pipe.connectors(embeds, mask, padding_side=padding_side)
        return Conditioning({"prompt_embeds": video, "audio_prompt_embeds": audio, "attention_mask": mask}).to(
            device=device
        )

    # media
    def load_vae(self, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> ModelMixin:
        """The video VAE (tiled with `--vae-tiling on`), the audio VAE and the vocoder (eval, cached); the first."""
        vae = tiled_if_asked(load_pretrained(self.vae_class, self.path, "vae", dtype), self.family_options)
        audio_vae = load_pretrained(AutoencoderKLLTX2Audio, self.path, "audio_vae", dtype)
        vocoder_class = LTX2VocoderWithBWE if self._vocoder_class_name() == "LTX2VocoderWithBWE" else LTX2Vocoder
        vocoder = load_pretrained(vocoder_class, self.path, "vocoder", dtype)
        for name, module in (("vae", vae), ("audio_vae", audio_vae), ("vocoder", vocoder)):
            self._loaded[name] = moved_to(module, device).eval().requires_grad_(False)
        return vae

    def _vocoder_class_name(self) -> str:
        return str(self.read_json("model_index.json")["vocoder"][1])

    def _media_modules(self) -> tuple[ModelMixin, ModelMixin, ModelMixin]:
        if "vocoder" not in self._loaded:
            self.load_vae()
        return self._loaded["vae"], self._loaded["audio_vae"], self._loaded["vocoder"]

    def encode_images(self, images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        raise NotImplementedError(
            f"the {self.name} family has no image encoding: its latent is a joint video + audio latent "
            "(sft_loss is not supported for it)"
        )

    def split_latents(self, latents: torch.Tensor, resolution: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Joint latents (B, D) -> the video latents (B, C, F, H, W) and the audio latents (B, C_a, L, M), views."""
        video_shape, audio_shape = self.stream_shapes(resolution or self._resolution_of(latents))
        split = math.prod(video_shape)
        return (
            latents[:, :split].reshape(-1, *video_shape),
            latents[:, split:].reshape(-1, *audio_shape),
        )

    def join_latents(self, video: torch.Tensor, audio: torch.Tensor) -> torch.Tensor:
        """The inverse of `split_latents`: (B, D) = video flattened then audio flattened."""
        return torch.cat([video.flatten(1), audio.flatten(1)], dim=1)

    def draw_noise(self, generator: torch.Generator, resolution: int | None = None) -> torch.Tensor:
        """One sample's standard normal joint latent as LTX2Pipeline draws it from the sample's generator: the video
        latent first, then the audio latent."""
        video_shape, audio_shape = self.stream_shapes(resolution)
        video = torch.randn(video_shape, generator=generator)
        audio = torch.randn(audio_shape, generator=generator)
        return torch.cat([video.flatten(), audio.flatten()])

    @torch.no_grad()
    def decode_latents(self, x0: torch.Tensor) -> Media:
        """Frames (B, F, 3, H, W) in [0, 1] at `frame_rate` and the vocoder's waveform (B, channels, samples) in
        [-1, 1], as LTX2Pipeline decodes (decode_timestep 0, no decode noise)."""
        vae, audio_vae, vocoder = self._media_modules()
        video, audio = self.split_latents(x0)
        video = video.to(device=vae.device, dtype=torch.float32)
        mean = vae.latents_mean.view(1, -1, 1, 1, 1).to(video)
        std = vae.latents_std.view(1, -1, 1, 1, 1).to(video)
        z = (video * std / vae.config.scaling_factor + mean).to(vae.dtype)
        timestep = None
        if vae.config.timestep_conditioning:
            timestep = torch.zeros(z.shape[0], device=z.device, dtype=z.dtype)
        frames = vae.decode(z, timestep, return_dict=False)[0]
        frames = (frames.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4)
        tokens = pack_audio(audio.to(device=audio_vae.device, dtype=torch.float32))
        tokens = tokens * audio_vae.latents_std.to(tokens) + audio_vae.latents_mean.to(tokens)
        mel = audio_vae.decode(unpack_audio(tokens, audio.shape[-1]).to(audio_vae.dtype), return_dict=False)[0]
        waveform = vocoder(mel.to(vocoder.dtype)).float().clamp(-1, 1)
        return Media(frames, fps=self.frame_rate, audio=waveform, sample_rate=int(vocoder.config.output_sampling_rate))

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
        """The joint velocity (float32, (B, D)) at noise levels `sigmas` (B,), as LTX2Pipeline's denoising loop
        computes both streams' velocities: timestep σ·1000 (also its `sigma`), cross-modality timesteps on
        (`use_cross_timestep`), positions of the latent frames at `frame_rate`; with w > 1 CFG over [negative;
        positive] in one batched forward, in x0 space: x̂₀ = x̂₀(c) + (w − 1)(x̂₀(c) − x̂₀(u)) per stream; then
        guidance rescale 0.7 per stream; the velocity (x − x̂₀)/σ. `negative` may be a batch of one (broadcast)."""
        check_velocity_inputs(latents, sigmas, embeds)
        batch = latents.shape[0]
        resolution = self._resolution_of(latents)
        video, audio = self.split_latents(latents.float(), resolution)
        patch, patch_t = self.transformer_patch_sizes
        _, frames, height, width = video.shape[1:]
        video_tokens, audio_tokens = pack_video(video, patch, patch_t), pack_audio(audio)
        dtype = compute_dtype(transformer)
        device = latents.device
        timestep = sigmas.to(device=device, dtype=torch.float32) * 1000.0
        hidden, audio_hidden, cond = video_tokens, audio_tokens, embeds
        cfg = guidance_scale > 1.0
        if cfg:
            if negative is None:
                raise ValueError("guidance_scale > 1 needs negative embeddings (see encode_negative)")
            cond = Conditioning.cat([negative.expand(batch), embeds])
            hidden, audio_hidden = torch.cat([hidden, hidden]), torch.cat([audio_hidden, audio_hidden])
            timestep = torch.cat([timestep, timestep])
        cond = cond.to(device=device, dtype=dtype)
        pred_video, pred_audio = joint_forward(
            transformer,
            (hidden.to(dtype), audio_hidden.to(dtype)),
            cond,
            timestep,
            ((frames // patch_t, height // patch, width // patch), audio.shape[2]),
            self.frame_rate,
        )
        sigma = sigmas.to(device=device, dtype=torch.float32).view(batch, 1, 1)
        video_velocity = guided_stream_velocity(video_tokens, pred_video.float(), sigma, guidance_scale, cfg)
        audio_velocity = guided_stream_velocity(audio_tokens, pred_audio.float(), sigma, guidance_scale, cfg)
        return self.join_latents(
            unpack_video(video_velocity, tuple(video.shape[1:]), patch, patch_t),
            unpack_audio(audio_velocity, audio.shape[-1]),
        )

    def mu(self, resolution: int | None = None) -> float:
        """LTX2Pipeline's shift: `calculate_shift` of the video token count, with its defaults for missing keys."""
        (_, frames, height, width), _ = self.stream_shapes(resolution)
        patch, patch_t = self.transformer_patch_sizes
        config = self.scheduler_config()
        return calculate_shift(
            (frames // patch_t) * (height // patch) * (width // patch),
            config.get("base_image_seq_len", 1024),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.95),
            config.get("max_shift", 2.05),
        )

    def sampling_sigmas(self, num_steps: int, resolution: int | None = None) -> torch.Tensor:
        """LTX2Pipeline's grid (both streams'): σ = linspace(1, 1/N, N) through the folder's scheduler with
        `mu(resolution)`, then 0."""
        sigmas = dynamic_shift_sigmas(self.scheduler_config(), num_steps, self.mu(resolution))
        if not torch.isfinite(sigmas).all():  # shift_terminal stretches the grid to end there: 1 step cannot
            raise ValueError(
                f"{num_steps} step(s) give no finite σ grid with this folder's scheduler "
                f"(shift_terminal={self.scheduler_config().get('shift_terminal')}); use --diffusion-num-steps >= 2"
            )
        return sigmas

    def sampling_shift(self, resolution: int | None = None) -> float:
        """LTX2Pipeline's time shift at `resolution` as a static shift: e^mu (exponential time shift; its
        shift_terminal stretch, an affine map of σ, is not part of it)."""
        return dynamic_sampling_shift(self.scheduler_config(), self.mu(resolution))

    # geometry
    @property
    def scheduler_shift(self) -> float:
        """The training table's shift: 1 under dynamic shifting (the table unshifted), the config's `shift`
        otherwise."""
        return training_shift(self.scheduler_config())

    def _vae_config(self) -> dict[str, Any]:
        return self.cached_json("vae", "config.json")

    def _vae_factors(self) -> tuple[int, int]:
        """(spatial, temporal) compression of the video VAE (`vae_factors`)."""
        return vae_factors(self._vae_config())

    @property
    def vae_scale_factor(self) -> int:
        return self._vae_factors()[0]

    @property
    def vae_scale_factor_temporal(self) -> int:
        return self._vae_factors()[1]

    @property
    def transformer_patch_sizes(self) -> tuple[int, int]:
        """(spatial, temporal) patch sizes the pipeline packs video latents with (the transformer's config)."""
        if "patch_sizes" not in self._loaded:
            config = self.read_json("transformer", "config.json")
            self._loaded["patch_sizes"] = (int(config.get("patch_size", 1)), int(config.get("patch_size_t", 1)))
        return self._loaded["patch_sizes"]

    @property
    def patch_size(self) -> int:
        return self.transformer_patch_sizes[0]

    @property
    def default_resolution(self) -> int:
        """The folder's suggested resolution (`folder_default`), else 512: LTX2Pipeline's default height (its default
        frame is 512x768; miles samples square frames)."""
        return int(self.folder_default("resolution") or LTX2_DEFAULT_RESOLUTION)

    def audio_latent_frames(self) -> int:
        """Audio latent frames of `num_frames` at `frame_rate`, rounded as LTX2Pipeline does."""
        config = self.read_json("audio_vae", "config.json")
        per_second = config["sample_rate"] / config["mel_hop_length"] / float(LATENT_DOWNSAMPLE_FACTOR)
        return round(self.num_frames / self.frame_rate * per_second)

    def stream_shapes(self, resolution: int | None = None) -> tuple[tuple[int, int, int, int], tuple[int, int, int]]:
        """One sample's video latent (C, F, H, W) and audio latent (C_a, L, M) of `num_frames` square frames."""
        key = ("stream_shapes", resolution or self.default_resolution, self.num_frames)
        if key in self._loaded:
            return self._loaded[key]
        resolution = key[1]
        spatial, temporal = self._vae_factors()
        patch, patch_t = self.transformer_patch_sizes
        multiple = math.lcm(32, spatial * patch)  # the pipeline checks multiples of 32
        if resolution % multiple:
            raise ValueError(f"resolution {resolution} must be a multiple of {multiple} (LTX-2 VAE factor x patch)")
        frames = (self.num_frames - 1) // temporal + 1
        if frames % patch_t:
            raise ValueError(f"{frames} latent frames do not split into temporal patches of {patch_t}")
        audio = self.read_json("audio_vae", "config.json")
        video_shape = (int(self._vae_config()["latent_channels"]), frames, resolution // spatial, resolution // spatial)
        audio_shape = (
            int(audio["latent_channels"]),
            self.audio_latent_frames(),
            audio["mel_bins"] // LATENT_DOWNSAMPLE_FACTOR,
        )
        self._loaded[key] = (video_shape, audio_shape)
        return self._loaded[key]

    def latent_shape(self, resolution: int | None = None) -> tuple[int]:
        """(D,): the video latent's size plus the audio latent's (see the module docstring)."""
        video_shape, audio_shape = self.stream_shapes(resolution)
        return (math.prod(video_shape) + math.prod(audio_shape),)

    def _resolution_of(self, latents: torch.Tensor) -> int:
        """The resolution whose joint latent has `latents.shape[1]` dims (the latents carry no other geometry)."""
        size = latents.shape[-1]
        if latents.ndim != 2:
            raise ValueError(f"{self.name} latents are joint (B, D) vectors, got {tuple(latents.shape)}")
        key = ("resolution_of", size, self.num_frames)
        if key not in self._loaded:
            spatial = self.vae_scale_factor
            (channels, frames, _, _), audio_shape = self.stream_shapes(None)
            video_size = size - math.prod(audio_shape)
            side = math.isqrt(max(video_size // (channels * frames), 0))
            if video_size <= 0 or channels * frames * side * side != video_size:
                raise ValueError(f"no square resolution of {self.num_frames} frames has a joint latent of {size} dims")
            self._loaded[key] = side * spatial
        return self._loaded[key]
