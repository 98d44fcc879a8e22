"""The FLUX.2 families, their shared code in `Flux2Family` (`folder.py`); each computed exactly as its diffusers
pipeline, from a local pipeline folder:
- `flux2` (FLUX.2 [klein], `Flux2KleinPipeline`): a Qwen3 text encoder whose hidden states 9, 18 and 27 are stacked;
  true CFG on klein-base, none on a step-distilled klein;
- `flux2-dev` (FLUX.2 [dev], `Flux2Pipeline`): a Mistral3 text encoder (Mistral-Small-3 chat template with the
  pipeline's system message) whose hidden states 10, 20 and 30 are stacked, and a guidance embedding (guidance-
  distilled: --diffusion-guidance-scale is the value embedded, one forward, no negative).

FLUX.2 [dev]'s `tokenizer/` is a `PixtralProcessor`, which transformers 5 cannot import without torchvision (its
torchvision image processor is imported at module level). Flux2Pipeline.encode_prompt uses only the processor's text
path (its chat template rendered and tokenized; no image goes to the text encoder), so the family loads the
folder's tokenizer (AutoTokenizer, as the processor does) with the processor's chat template and gives it to the
pipeline: the token ids and attention mask are the processor's (compared on the tiny tokenizer, with truncation).

Not covered: the pipelines' prompt upsampling (`caption_upsample_temperature`: the Mistral3 model generating a new
prompt, with the vision tower and the processor's image path) and klein's KV-cached references.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from miles.models.base import RunAlgorithm, register_train_pipeline_config
from miles.models.diffusers_family import diffusers_class
from miles.models.flux2.folder import FLUX2_DEV_TEXT_LAYERS, FLUX2_TEXT_LAYERS, Flux2Family


@register_train_pipeline_config
class Flux2KleinPipelineConfig(Flux2Family):
    """FLUX.2 [klein] pipeline folders (`Flux2KleinPipeline`, Qwen3 text encoder), `Flux2Family`'s conditioning.

    Guidance as the pipeline's: klein-base (`is_distilled` false) runs true CFG for w > 1, the negative text (the
    pipeline's "", or --negative-prompt) with the same reference tokens; a step-distilled klein runs no CFG, so w > 1
    is refused at start-up, and the teacher's and NFT's scales too (the pipeline would ignore it). The transformer
    has no guidance embedding (`guidance` None).
    """

    name = "flux2"
    pipeline_class_name = "Flux2KleinPipeline"
    text_pipeline_class = "Flux2KleinPipeline"
    checkpoint_name = "FLUX.2 [klein]"
    default_text_layers = FLUX2_TEXT_LAYERS

    def __init__(self, path: str, **options: Any) -> None:
        super().__init__(path, **options)
        self.is_distilled = bool(self.index.get("is_distilled", False))

    def check_run_args(self, args: argparse.Namespace, algorithm: RunAlgorithm) -> None:
        """`Flux2Family.check_run_args`, and CFG on a step-distilled folder (the pipeline ignores it): the sampling
        scale and the run's algorithm's own CFG scales (its declared `guidance_flags`) above 1."""
        super().check_run_args(args, algorithm)
        dests = ("diffusion_guidance_scale", *algorithm.guidance_flags)
        scales = {"--" + dest.replace("_", "-"): getattr(args, dest) for dest in dests}
        for flag, scale in scales.items():
            if self.is_distilled and scale is not None and scale > 1.0:
                raise ValueError(
                    f"{flag} {scale} with the step-distilled {self.path} (is_distilled): Flux2KleinPipeline runs no "
                    "CFG for it; use 1.0 or a klein-base folder"
                )

    def true_cfg(self, guidance_scale: float) -> bool:
        """w > 1 on klein-base; an error on a step-distilled klein (the pipeline runs no CFG for it)."""
        if guidance_scale > 1.0 and self.is_distilled:
            raise ValueError(
                f"guidance_scale {guidance_scale} with the step-distilled {self.path}: the pipeline runs no CFG for it"
            )
        return guidance_scale > 1.0

    def embedded_guidance(self, guidance_scale: float, batch: int, device: torch.device) -> torch.Tensor | None:
        return None


@register_train_pipeline_config
class Flux2DevPipelineConfig(Flux2Family):
    """FLUX.2 [dev] pipeline folders (`Flux2Pipeline`, Mistral3 text encoder read through its processor's chat
    template with the pipeline's system message), `Flux2Family`'s conditioning.

    Guidance as the pipeline's: guidance-distilled, the transformer embeds w (the pipeline's `guidance_scale`,
    default 4.0) at every step, one forward, no negative and no true CFG, for every w (1.0 too: the value 1 is
    embedded, it does not switch anything off). In miles --diffusion-guidance-scale is that w (its default is the
    algorithm's, not the pipeline's 4.0), and an algorithm's own scales (the DMD2 teacher's, NFT's) are the embedded
    w of their forwards, as for FLUX.1-dev (`flux`). Flux2Pipeline has no negative prompt: a --negative-prompt is
    refused at start-up.
    """

    name = "flux2-dev"
    pipeline_class_name = "Flux2Pipeline"
    text_pipeline_class = "Flux2Pipeline"
    checkpoint_name = "FLUX.2 [dev]"
    default_text_layers = FLUX2_DEV_TEXT_LAYERS

    def check_run_args(self, args: argparse.Namespace, algorithm: RunAlgorithm) -> None:
        """`Flux2Family.check_run_args`, and a --negative-prompt (Flux2Pipeline has none: its guidance is embedded)."""
        super().check_run_args(args, algorithm)
        if args.negative_prompt:
            raise ValueError(
                f"--negative-prompt with the {self.name} family: Flux2Pipeline (FLUX.2 [dev], guidance-distilled) has "
                "no negative prompt and runs no CFG; --diffusion-guidance-scale is its embedded guidance"
            )

    def load_text_encoders(self, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> Any:
        """Flux2Pipeline with its text encoder only, and as its `tokenizer` the folder's tokenizer with the
        processor's chat template (`load_tokenizer`): the pipeline's own encode_prompt then renders, tokenizes and
        encodes as its __call__ does."""
        pipe = self.load_text_pipeline(
            diffusers_class(self.text_pipeline_class),  # imported here: a trainer rank never loads it
            without=(*self.non_text_components, "tokenizer"),
            frozen=self.text_modules,
            device=device,
            dtype=dtype,
        )
        pipe.register_modules(tokenizer=self.load_tokenizer())
        return pipe

    def load_tokenizer(self) -> Any:
        """`tokenizer/`'s tokenizer as its PixtralProcessor holds it (AutoTokenizer) with the chat template the
        processor applies (`processor_chat_template`). A folder whose `tokenizer/` is a plain tokenizer (the tiny
        one) reads the same way."""
        from transformers import AutoTokenizer

        folder = Path(self.path, "tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        tokenizer.chat_template = processor_chat_template(folder)
        return tokenizer

    def true_cfg(self, guidance_scale: float) -> bool:
        return False

    def embedded_guidance(self, guidance_scale: float, batch: int, device: torch.device) -> torch.Tensor | None:
        """`torch.full([1], guidance_scale, dtype=float32).expand(batch)`, as Flux2Pipeline passes it."""
        return torch.full((batch,), float(guidance_scale), device=device, dtype=torch.float32)


def processor_chat_template(folder: Path) -> str:
    """The chat template a transformers processor saved in `folder` applies, found as `ProcessorMixin.from_pretrained`
    finds it: `processor_config.json`'s "chat_template", else the legacy `chat_template.json`'s, else
    `chat_template.jinja` (the default template; a tokenizer saves its own there too)."""
    config = folder / "processor_config.json"
    if config.is_file() and json.loads(config.read_text()).get("chat_template") is not None:
        template = json.loads(config.read_text())["chat_template"]
    elif (folder / "chat_template.json").is_file():
        template = json.loads((folder / "chat_template.json").read_text())["chat_template"]
    elif (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text()
    else:
        raise FileNotFoundError(
            f"{folder} has no chat template (processor_config.json, chat_template.json or chat_template.jinja): "
            "Flux2Pipeline renders its prompts with the processor's"
        )
    return template["default"] if isinstance(template, dict) else template
