"""Model families: the `TrainPipelineConfig` interface (the family contract) and the family registry.

A family knows how to load one kind of diffusers pipeline folder and run its networks the way its pipeline does:
its conditioning (`Conditioning`, names of its choosing), its latent geometry (any rank), its decoded media (`Media`)
and its default LoRA targets. Code outside `miles/models/` relies on this interface only.
"""

from __future__ import annotations

import json
import logging
from abc import ABC, abstractmethod
from importlib import import_module
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import accelerate
import diffusers.utils.deprecation_utils
import torch
from diffusers.models.modeling_utils import no_init_weights
from torch import nn

from miles.diffusion.schedule import sampling_sigmas as static_shift_sampling_sigmas
from miles.models.conditioning import Conditioning
from miles.models.configs_only import keep_fp32_parameters, module_from_config, pipeline_components_from_configs
from miles.models.media import Media
from miles.models.options import FamilyOption, family_options, option_flag  # noqa: F401  (family_options: re-exported)
from miles.models.registry import BUILTIN_FAMILIES, builtin_family_of_pipeline
from miles.models.sequence_parallel import SequenceParallelGroup, sequence_parallel_problems
from miles.utils import import_gc
from miles.utils.misc import load_function
from miles.utils.simulation import simulating

logger = logging.getLogger(__name__)

# from_pretrained's dtype keyword: `dtype` in the diffusers versions that renamed it, `torch_dtype` before
DTYPE_KW = "dtype" if hasattr(diffusers.utils.deprecation_utils, "_resolve_dtype") else "torch_dtype"
# safetensors' dtype names (a file header's "dtype") -> torch dtypes
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
# where `load_pretrained(..., empty=True)` records the folder whose safetensors hold a module's weights
CHECKPOINT_FOLDER_ATTR = "_miles_checkpoint_folder"


def load_pretrained(
    cls: type[nn.Module], root: str | Path, subfolder: str | None, dtype: torch.dtype, *, empty: bool = False
) -> nn.Module:
    """`cls.from_pretrained(root, subfolder=..., dtype=...)` in eval mode, or with `empty=True` the same module with
    its parameters on the meta device and no weights read, tagged with its weights' folder (`CHECKPOINT_FOLDER_ATTR`)
    so that a sharded loader can fill each rank's shards from the files (`miles.backends.fsdp_utils.sharded_load`).

    The empty module is built as from_pretrained builds it: under `dtype` as the default dtype (buffers computed at
    construction get it), weights initialisation skipped, and the class's `_keep_in_fp32_modules` parameters in fp32.

    Under the planner's simulation (`miles.utils.simulation`) no weight file is read: the module is built from its
    config with fake weights (`module_from_config`).
    """
    folder = Path(root) / subfolder if subfolder else Path(root)
    if not empty:
        if simulating():
            return module_from_config(cls, folder, dtype)
        return cls.from_pretrained(str(root), subfolder=subfolder, **{DTYPE_KW: dtype}, local_files_only=True).eval()
    config = cls.load_config(str(folder), local_files_only=True)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with no_init_weights(), accelerate.init_empty_weights(include_buffers=False):
            model = cls.from_config(config)
    finally:
        torch.set_default_dtype(previous)
    keep_fp32_parameters(model, cls, dtype)
    setattr(model, CHECKPOINT_FOLDER_ATTR, folder)
    return model.eval()


class TrainPipelineConfig(ABC):
    """One model family: loading its networks from a local pipeline folder and running them as its pipeline does.

    Loaded text encoders and VAE are cached on the instance and dropped when it is pickled (Ray sends the path only).
    """

    name: ClassVar[str]
    pipeline_class_name: ClassVar[str]  # the model_index.json "_class_name" this family handles
    # module names `--use-lora` targets unless --lora-target-modules is given; empty: the flag is required
    default_lora_targets: ClassVar[tuple[str, ...]] = ()
    # the run options this family reads (`miles.models.options`: its flags, ranges, help); others are refused
    options: ClassVar[tuple[FamilyOption, ...]] = ()
    # whether the trainer may split a sample's tokens over --sp-size ranks (Ulysses): such a family implements
    # `sequence_parallel_problems` and `apply_sequence_parallel`; the others refuse --sp-size > 1 at start-up
    supports_sequence_parallel: ClassVar[bool] = False
    # why `--compile` cannot run this family's transformer (the run is refused at start-up with it); None: it can
    compile_refusal: ClassVar[str | None] = None
    # editing and image-to-video: how many source images each prompt takes, (fewest, most); (0, 0) is text only.
    # A family with a non-zero range implements `encode_prompts(prompts, device, images=...)`
    source_image_range: ClassVar[tuple[int, int]] = (0, 0)
    # its negative conditioning encodes each prompt's source images (`encode_negative_of_images` returns a row per
    # prompt) rather than one text row shared by the batch
    negative_per_prompt: ClassVar[bool] = False
    # a prompt's conditioning rows encoded alone equal its rows in any batch, bit for bit (fixed-length padding, no
    # kernel whose sums depend on the batch size): cached encodings (`--prompt-cache auto`) then change no sample
    prompt_cache_exact: ClassVar[bool] = False

    def __init__(self, path: str, **options: Any) -> None:
        self.path = str(check_pipeline_components(check_pipeline_folder(path), self.name))
        self._loaded: dict[str, Any] = {}
        given = {k: v for k, v in options.items() if v is not None}
        refused = sorted(set(given) - {option.name for option in self.options})
        if refused:
            flags = ", ".join(option_flag(k) for k in refused)
            raise ValueError(f"{flags} does not apply to the {self.name} family ({self.pipeline_class_name})")
        self.family_options: dict[str, Any] = given

    def __repr__(self) -> str:
        return f"{type(self).__name__}(path={self.path!r})"

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_loaded"] = {}
        return state

    def tokenizer_limit(self, tokenizer: str, cap: int) -> int:
        """Tokens per prompt: the `tokenizer` folder's `model_max_length`, at most the pipeline's default `cap`."""
        limit = self.read_json(tokenizer, "tokenizer_config.json").get("model_max_length", cap)
        return int(min(limit, cap))

    def load_text_pipeline(
        self,
        pipeline_class: type,
        *,
        without: tuple[str, ...],
        frozen: tuple[str, ...],
        device: torch.device | str,
        dtype: torch.dtype,
        components: dict[str, Any] | None = None,
    ) -> Any:
        """The folder's `pipeline_class` with the components named in `without` left out (None) and those in
        `components` given rather than loaded (a module the family already holds), its `frozen`
        modules in eval mode without gradients, cached as the family's text encoders (`text_pipeline`): the
        pipeline's own `encode_prompt` then encodes exactly as its `__call__` does. Negatives cached from the
        previous encoders are dropped. Under the planner's simulation its networks and tokenizers are built from the
        folder's configs (`pipeline_components_from_configs`), no weight read."""
        components = dict(components or {})
        if simulating():
            wanted = set(read_model_index(Path(self.path))) - set(without) - set(components)
            components = {**pipeline_components_from_configs(self.path, wanted, dtype), **components}
        pipe = pipeline_class.from_pretrained(
            self.path, **dict.fromkeys(without), **components, **{DTYPE_KW: dtype}, local_files_only=True
        ).to(device)
        pipe.set_progress_bar_config(disable=True)
        for name in frozen:
            if getattr(pipe, name, None) is not None:
                getattr(pipe, name).eval().requires_grad_(False)
        self.drop_cached_negatives()
        self._loaded["text"] = pipe
        return pipe

    def text_pipeline(self) -> Any:
        """The text-encoding pipeline `load_text_encoders` built; on first use loaded on the CPU in float32."""
        return self._loaded["text"] if "text" in self._loaded else self.load_text_encoders()

    def read_json(self, *parts: str) -> dict[str, Any]:
        """A JSON file inside the pipeline folder, e.g. `read_json("vae", "config.json")`."""
        file = Path(self.path, *parts)
        if not file.is_file():
            raise FileNotFoundError(f"{file} is missing: {self.path} is not a complete {self.name} pipeline folder")
        return json.loads(file.read_text())

    # networks
    @abstractmethod
    def load_transformer(
        self, path: str | None = None, dtype: torch.dtype = torch.float32, *, empty: bool = False
    ) -> nn.Module:
        """The trained network from a pipeline folder (default: this one). With `empty=True` its parameters are on the
        meta device and every module that holds weights is tagged with its folder (`load_pretrained(...,
        empty=True)`): the trainer shards it first and each rank then reads only its own rows. A family that does not
        take `empty` is loaded whole on every rank (a warning says so)."""

    @abstractmethod
    def transformer_blocks(self, transformer: nn.Module) -> list[nn.Module]: ...

    @abstractmethod
    def save_transformer(self, transformer_state_dict: dict[str, torch.Tensor], out_dir: str) -> str: ...

    def saved_transformer_dtypes(self) -> dict[str, torch.dtype]:
        """The dtype `save_transformer` stores each state-dict entry in (--save-hf gathers it in that dtype, not in
        the fp32 masters); an entry not named is stored as given."""
        return {}

    # text
    @abstractmethod
    def load_text_encoders(self, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> Any: ...

    @abstractmethod
    def encode_prompts(self, prompts: list[str], device: torch.device | str | None = None) -> Conditioning:
        """One row per prompt; the names and shapes are the family's (what `predict_velocity` reads)."""

    def encode_negative(
        self, batch_size: int, negative_prompt: str = "", device: torch.device | str | None = None
    ) -> Conditioning:
        """Conditioning of `negative_prompt` for `batch_size` rows; encoded once per prompt and device, then cached."""
        key = ("negative", negative_prompt, None if device is None else str(device))
        if key not in self._loaded:
            self._loaded[key] = self.encode_prompts([negative_prompt], device=device)
        return self._loaded[key].expand(batch_size)

    @property
    def takes_source_images(self) -> bool:
        """Whether this family's samples are conditioned on source images (editing, image-to-video)."""
        return self.source_image_range[1] > 0

    def source_image_problem(self, counts: list[int]) -> str | None:
        """Why prompts with `counts` source images each cannot run on this family (None: they can)."""
        low, high = self.source_image_range
        wrong = sorted({n for n in counts if not low <= n <= high})
        if not wrong:
            return None
        if high == 0:
            return (
                f"the {self.name} family ({self.pipeline_class_name}) generates from text only, but the prompts "
                "carry source images; use an editing or image-to-video family"
            )
        want = str(low) if low == high else f"{low} to {high}"
        return (
            f"the {self.name} family ({self.pipeline_class_name}) takes {want} source image(s) per prompt, "
            f"got prompts with {', '.join(map(str, wrong))}"
        )

    def check_source_images(self, num_prompts: int, images: list[list[Any]] | None) -> None:
        """Raise ValueError unless `images` (None: text only) holds one list per prompt, each with as many images
        as this family takes (`source_image_range`)."""
        if images is not None and len(images) != num_prompts:
            raise ValueError(f"{num_prompts} prompts but {len(images)} source image lists")
        problem = self.source_image_problem([0] * num_prompts if images is None else [len(i) for i in images])
        if problem is not None:
            raise ValueError(problem)

    def encode_request(
        self,
        prompts: list[str],
        source_images: list[list[Any]] | None,
        negative_prompt: str,
        *,
        negative: bool,
        device: torch.device | str | None = None,
    ) -> tuple[Conditioning, Conditioning | None]:
        """An engine request's conditioning (one row per prompt) and, when `negative`, its negative conditioning.

        Text families: `encode_prompts(prompts)` and the cached one-row `encode_negative`. Families that take source
        images: `encode_prompts(prompts, images=source_images)` (each image (H, W, 3) uint8) and
        `encode_negative_of_images`, which may return one row or one per prompt (`negative_columns` takes both)."""
        self.check_source_images(len(prompts), source_images)
        if source_images is None:
            embeds = self.encode_prompts(prompts, device=device)
            return embeds, self.encode_negative(1, negative_prompt, device=device) if negative else None
        embeds = self.encode_prompts(prompts, device=device, images=source_images)  # type: ignore[call-arg]
        return embeds, self.encode_negative_of_images(negative_prompt, source_images, device) if negative else None

    def encode_negative_of_images(
        self, negative_prompt: str, source_images: list[list[Any]], device: torch.device | str | None = None
    ) -> Conditioning:
        """The negative conditioning of prompts conditioned on `source_images`: by default the text alone (one row;
        the family's `predict_velocity` pairs it with each prompt's image inputs), as FLUX Kontext and Wan
        image-to-video guide. A family whose negative encodes the image too (`negative_per_prompt`) returns one row
        per prompt."""
        return self.encode_negative(1, negative_prompt, device=device)

    def check_run_args(self, args: Any) -> None:
        """Start-up checks of a run's flags against this folder, before any actor starts (the driver calls it);
        raise ValueError naming the flag. Default: none."""
        return None

    def sequence_parallel_problems(self, sp_size: int, resolution: int | None = None) -> list[str]:
        """Why --sp-size `sp_size` cannot run on this folder at `resolution` (empty: it can); checked at start-up.
        Default: any sp_size > 1 is refused, naming the family and the families that support it."""
        if sp_size == 1:
            return []
        supporting = sorted(name for name, cls in all_family_classes().items() if cls.supports_sequence_parallel)
        return sequence_parallel_problems(
            self.name, sp_size, heads=1, tokens=1, supported=False, supporting=", ".join(supporting)
        )

    def apply_sequence_parallel(self, transformer: nn.Module, sp: SequenceParallelGroup) -> None:
        """Split `transformer`'s tokens over the ranks of `sp` (before FSDP2 wraps it); families that declare
        `supports_sequence_parallel` implement it."""
        raise NotImplementedError(f"the {self.name} family does not support sequence parallelism (--sp-size)")

    def loaded_modules(self) -> list[nn.Module]:
        """Every network the family has loaded (text encoders, VAE and the like; not the transformer, which its
        caller holds): what an engine moves to the host while it sleeps (`--colocate-sleep`)."""
        modules: list[nn.Module] = []
        for value in self._loaded.values():
            parts = getattr(value, "components", None)  # a diffusers pipeline: its modules
            for part in parts.values() if isinstance(parts, dict) else [value]:
                if isinstance(part, nn.Module) and all(part is not m for m in modules):
                    modules.append(part)
        return modules

    def release_text_encoders(self) -> None:
        """Drop the text encoders and the negatives encoded with them (an engine whose prompts are all cached); a
        later `encode_prompts` loads them again."""
        self._loaded.pop("text", None)
        self.drop_cached_negatives()

    def drop_cached_negatives(self) -> None:
        """Forget encode_negative's cache (after reloading the text encoders)."""
        self._loaded = {k: v for k, v in self._loaded.items() if not (isinstance(k, tuple) and k[0] == "negative")}

    # media
    @abstractmethod
    def load_vae(self, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> nn.Module: ...

    @abstractmethod
    def encode_images(self, images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Normalized latents (B, *latent_shape) of images (B, 3, H, W) in [-1, 1] (what `sft_loss` trains on)."""

    @abstractmethod
    def decode_latents(self, x0: torch.Tensor) -> Media:
        """The media of normalized latents (B, *latent_shape): images, or frames (and audio) for video families."""

    # the flow
    @abstractmethod
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
        """The velocity (float32, the latents' shape) at noise levels `sigmas` (B,), with the family's guidance."""

    def sampling_sigmas(self, num_steps: int, resolution: int | None = None) -> torch.Tensor:
        """The σ grid the family's pipeline samples `num_steps` steps on at `resolution`: num_steps + 1 float32
        values from 1 down to 0. Default: the static-shift scheduler grid at `scheduler_shift`; a family whose
        pipeline shifts by resolution (FLUX's `mu`) overrides it."""
        return static_shift_sampling_sigmas(num_steps, self.scheduler_shift)

    def sampling_shift(self, resolution: int | None = None) -> float:
        """The static shift s of `sampling_sigmas` at `resolution`: its σ follow σ = s·t/(1 + (s − 1)·t) of the
        unshifted time t (MixGRPO-Flash's compressed grid after the window follows the same map). Default:
        `scheduler_shift`, the shift of the default grid; a family that shifts by resolution overrides it."""
        return self.scheduler_shift

    # geometry
    @property
    @abstractmethod
    def scheduler_shift(self) -> float:
        """The static shift of the scheduler's training σ table (sft_loss draws, DMD2's default timestep shift)."""

    @property
    @abstractmethod
    def vae_scale_factor(self) -> int: ...

    @property
    @abstractmethod
    def default_resolution(self) -> int: ...

    @abstractmethod
    def latent_shape(self, resolution: int | None = None) -> tuple[int, ...]:
        """One sample's latent without the batch dimension: (C, H, W) for images, (C, F, H, W) for video."""

    def draw_noise(self, generator: torch.Generator, resolution: int | None = None) -> torch.Tensor:
        """One sample's standard normal latent (`latent_shape`) drawn from `generator`, as the family's pipeline
        draws its initial latents (what the engine's seeded noise goes through). Default: one `torch.randn`; a
        family whose latent joins several pipeline latents (LTX-2: video then audio) draws them in its order."""
        return torch.randn(self.latent_shape(resolution), generator=generator)


def compute_dtype(network: nn.Module) -> torch.dtype:
    """The dtype a network's forward runs in: the `compute_dtype` a mixed-precision wrapper set on it or on a module
    inside it (FSDP2 stores fp32 master weights and computes in its param dtype), else its parameters' dtype (of those
    not kept in fp32: a bf16 Wan loaded by from_pretrained holds fp32 norms and tables first).

    A family's `predict_velocity` casts its inputs to this dtype, so engines and trainer cast alike."""
    kept: set[str] = set()  # modules diffusers keeps in fp32 whatever the dtype (Wan's scale_shift_table, norms)
    for module in network.modules():
        dtype = module.__dict__.get("compute_dtype")
        if dtype is not None:
            return dtype
        kept.update(getattr(module, "_keep_in_fp32_modules", None) or ())
    for name, param in network.named_parameters():
        if not kept.intersection(name.split(".")):
            return param.dtype
    return next(network.parameters()).dtype


def check_pipeline_folder(path: str | Path) -> Path:
    """`path` as a Path if it is a local diffusers pipeline folder (has model_index.json); a clear error otherwise."""
    folder = Path(path).expanduser()
    hint = "--hf-checkpoint must be a local diffusers pipeline folder (nothing is downloaded)"
    if not folder.exists():
        raise FileNotFoundError(f"pipeline folder {str(path)!r} does not exist; {hint}")
    if not folder.is_dir():
        raise NotADirectoryError(f"pipeline path {str(path)!r} is not a folder; {hint}")
    if not (folder / "model_index.json").is_file():
        raise FileNotFoundError(f"{str(path)!r} has no model_index.json; {hint}")
    return folder


def read_model_index(folder: Path) -> dict[str, Any]:
    """The folder's model_index.json as a dict; an error naming the file and the folder when it is not a JSON object
    (binary bytes, truncated text)."""
    file = folder / "model_index.json"
    try:
        index = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{file} is not JSON ({exc}): {folder} is not a diffusers pipeline folder") from None
    if not isinstance(index, dict):
        raise ValueError(f"{file} is not a JSON object: {folder} is not a diffusers pipeline folder")
    return index


def check_pipeline_components(folder: Path, family: str) -> Path:
    """`folder` if every component its model_index.json lists (`"vae": ["diffusers", "AutoencoderKL"]`; null entries
    are absent by design) has its subfolder; an error naming the first missing component and its class otherwise
    (diffusers would fail less clearly, and a missing tokenizer folder can even load as an empty tokenizer)."""
    index = read_model_index(folder)
    for component, spec in index.items():
        if component.startswith("_") or not isinstance(spec, list) or len(spec) != 2 or spec[1] is None:
            continue
        if not (folder / component).is_dir():
            raise FileNotFoundError(
                f"{folder} is not a complete {family} pipeline folder: model_index.json lists the component "
                f"{component!r} ({spec[1]}), but {folder / component} is missing"
            )
    return folder


def strip_name_or_path(folder: str | Path) -> list[Path]:
    """Remove `_name_or_path` from every JSON file under `folder`: from_pretrained records the folder a component
    was loaded from there, and save_pretrained writes it back, so a saved pipeline would name the machine it was
    built on. Returns the files rewritten."""
    rewritten = []
    for file in sorted(Path(folder).rglob("*.json")):
        data = json.loads(file.read_text())
        if isinstance(data, dict) and "_name_or_path" in data:
            del data["_name_or_path"]
            file.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
            rewritten.append(file)
    return rewritten


TRAIN_PIPELINE_CONFIGS: dict[str, type[TrainPipelineConfig]] = {}  # the families imported so far, by name

_C = TypeVar("_C", bound=type[TrainPipelineConfig])


def register_train_pipeline_config(cls: _C) -> _C:
    """Class decorator: make a family available under `cls.name`."""
    if cls.name in TRAIN_PIPELINE_CONFIGS and TRAIN_PIPELINE_CONFIGS[cls.name] is not cls:
        raise ValueError(f"model family {cls.name!r} is already registered by {TRAIN_PIPELINE_CONFIGS[cls.name]}")
    TRAIN_PIPELINE_CONFIGS[cls.name] = cls
    return cls


def family_class(name: str) -> type[TrainPipelineConfig] | None:
    """The family registered under `name`, importing a built-in one on first use; None when there is none."""
    if name not in TRAIN_PIPELINE_CONFIGS and name in BUILTIN_FAMILIES:
        with import_gc.paused():  # diffusers' pipelines and transformers' models, less CPU (import_gc)
            import_module(BUILTIN_FAMILIES[name].module)  # its decorator registers it
    return TRAIN_PIPELINE_CONFIGS.get(name)


def family_for_pipeline(class_name: str | None) -> type[TrainPipelineConfig] | None:
    """The family that handles the pipeline class `class_name` (model_index.json's `_class_name`): a registered
    one first (a user's family may take over a built-in pipeline class), then a built-in one; None when none does."""
    for cls in TRAIN_PIPELINE_CONFIGS.values():
        if cls.pipeline_class_name == class_name:
            return cls
    name = builtin_family_of_pipeline(class_name)
    return None if name is None else family_class(name)


def all_family_classes() -> dict[str, type[TrainPipelineConfig]]:
    """Every family, by name: the built-in ones (each imported) and those registered since."""
    for name in BUILTIN_FAMILIES:
        family_class(name)
    return dict(TRAIN_PIPELINE_CONFIGS)


def _known_families() -> str:
    """Each family's name and pipeline class, without importing a built-in one."""
    known = {name: entry.pipeline_class_name for name, entry in BUILTIN_FAMILIES.items()}
    known.update((name, cls.pipeline_class_name) for name, cls in TRAIN_PIPELINE_CONFIGS.items())
    return ", ".join(f"{name} ({pipeline})" for name, pipeline in sorted(known.items())) or "none"


def is_family_class_path(family: str) -> bool:
    """`file.py:Class` or `package.module.Class` (a user's family class), as opposed to a registered name."""
    return ":" in family or "." in family


def load_family_class(spec: str) -> type[TrainPipelineConfig]:
    """A user's model family class from `file.py:Class` or `package.module.Class`, registered under its `name`
    (--train-pipeline-config-path); a clear error when it is not a complete TrainPipelineConfig."""
    cls = load_function(spec)
    if not (isinstance(cls, type) and issubclass(cls, TrainPipelineConfig)):
        raise TypeError(f"--train-pipeline-config-path {spec}: {cls!r} is not a TrainPipelineConfig subclass")
    missing = sorted(getattr(cls, "__abstractmethods__", ()))
    unnamed = [attr for attr in ("name", "pipeline_class_name") if not isinstance(getattr(cls, attr, None), str)]
    if missing or unnamed:
        raise TypeError(
            f"--train-pipeline-config-path {spec}: {cls.__name__} must define "
            + ", ".join([*(f"class attribute {a}" for a in unnamed), *(f"method {m}" for m in missing)])
        )
    return register_train_pipeline_config(cls)


def get_train_pipeline_config(path: str, family: str = "auto", **options: Any) -> TrainPipelineConfig:
    """The family config for the pipeline folder `path`; "auto" picks it by model_index.json's `_class_name`, a
    class path (`file.py:Class`, from --train-pipeline-config-path) loads and registers the user's family.

    `options` (see `family_options`): the ones not None go to the family's constructor, which refuses those it
    does not accept."""
    folder = check_pipeline_folder(path)
    given = {k: v for k, v in options.items() if v is not None}  # a user's family may take the path only
    if is_family_class_path(family):
        return load_family_class(family)(str(folder), **given)
    if family != "auto":
        cls = family_class(family)
        if cls is None:
            raise ValueError(f"unknown model family {family!r}; known families: {_known_families()}")
        return cls(str(folder), **given)
    class_name = read_model_index(folder).get("_class_name")
    cls = family_for_pipeline(class_name)
    if cls is not None:
        return cls(str(folder), **given)
    raise ValueError(
        f"{path}/model_index.json names pipeline class {class_name!r}, which no model family handles; "
        f"known families: {_known_families()}"
    )
