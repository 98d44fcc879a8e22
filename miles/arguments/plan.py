"""The planner's flags (`--plan` and what it plans against; miles/plan/)."""

from __future__ import annotations

import argparse
import re

DEFAULT_PLAN_TFLOPS = 400.0  # sustained bf16 TFLOP/s per GPU: ~40% of an H100 SXM's dense peak
DEFAULT_PLAN_INTERCONNECT_GBPS = 400.0  # Gbit/s for the weight sync: one NDR InfiniBand link


# --plan-gpu's names: total memory as nvidia-smi reports it (MiB); `miles.plan.gpus` keeps the reserve
GPU_MEMORY_MIB = {
    "h100-80gb": 81559,
    "h200-141gb": 143771,
    "a100-80gb": 81920,
    "a100-40gb": 40960,
    "l40s-48gb": 46068,
}


def plan_gpu_memory(value: str) -> tuple[str, int]:
    """--plan-gpu read: (its name, its memory in bytes) for a known name or a size in GiB (`80`, `24.5`)."""
    name = value.strip().lower()
    if name in GPU_MEMORY_MIB:
        return name, GPU_MEMORY_MIB[name] << 20
    if re.fullmatch(r"\d+(\.\d+)?", name) and float(name) > 0:
        return f"{name} GiB", int(float(name) * 2**30)
    raise ValueError(f"--plan-gpu {value!r}: use one of {', '.join(GPU_MEMORY_MIB)} or a size in GiB (e.g. 80)")


def plan_gpu(text: str) -> str:
    """--plan-gpu as given, once it reads (`plan_gpu_memory`): refused at parse time, not when the plan (or a CUDA
    run's start-up check) first reads it."""
    try:
        plan_gpu_memory(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--plan-gpu ")) from None
    return text


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("plan (what fits, before a GPU is rented)")
    group.add_argument(
        "--plan",
        action="store_true",
        help="Do not train: simulate this run's start-up, one optimizer window, the weight sync and one engine call "
        "on fake tensors at the requested world size (one CPU process, no weights read, no Ray), print each GPU's "
        "peak memory per role and phase, the time estimates and whether it fits --plan-gpu (with flags that do "
        "when not), and write plan.json to --output-dir. With --device auto it plans for CUDA GPUs. Exit code 0: "
        "fits; 3: does not fit.",
    )
    group.add_argument(
        "--plan-gpu",
        type=plan_gpu,
        default="h100-80gb",
        help="The GPU a plan (and the start-up check on CUDA) is measured against: h100-80gb, h200-141gb, a100-80gb, "
        "a100-40gb, l40s-48gb, or a size in GiB. A reserve for the CUDA context, NCCL and fragmentation (1.5 GiB + "
        "5%%) is kept free.",
    )
    group.add_argument(
        "--plan-tflops",
        type=float,
        default=DEFAULT_PLAN_TFLOPS,
        help="Sustained TFLOP/s per GPU for the plan's time estimates (an H100's bf16 dense peak is ~989).",
    )
    group.add_argument(
        "--plan-interconnect-gbps",
        type=float,
        default=DEFAULT_PLAN_INTERCONNECT_GBPS,
        help="Gbit/s the weight sync moves the trainer's weights at, for the plan's time estimate.",
    )
    group.add_argument(
        "--no-plan-check",
        action="store_true",
        help="On CUDA, skip the start-up plan that refuses a run whose GPU would run out of memory.",
    )


# ---- `auto` sizes: concrete at parse (the CPU defaults); on CUDA the start-up plan may change them (miles/plan/auto.py)
AUTO = "auto"
CPU_MICRO_BATCH_SIZE = 32  # --micro-batch-size auto on CPU, and the start of the search on CUDA
AUTO_SIZED = ("micro_batch_size", "gradient_checkpointing", "rollout_micro_batch_size")
_ON, _OFF = ("on", "true", "yes", "1"), ("off", "false", "no", "0")


def parse_auto_size(text: str) -> int | str:
    """`auto` or a whole number >= 1 (--micro-batch-size)."""
    if text == AUTO:
        return AUTO
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give auto or a whole number >= 1") from None


def parse_on_off_auto(text: str) -> bool | str:
    """on / off (or true / false) -> True / False; auto stays auto (--gradient-checkpointing)."""
    lowered = str(text).lower()
    if lowered == AUTO:
        return AUTO
    if lowered in _ON or lowered in _OFF:
        return lowered in _ON
    raise argparse.ArgumentTypeError(f"{text!r}: give on, off or auto")


def auto_size_defaults(args: argparse.Namespace) -> dict[str, object]:
    """The `auto` sizes made concrete at once: --micro-batch-size 32 and --gradient-checkpointing off (the CPU
    defaults; a CPU run keeps them), --rollout-micro-batch-size left to the engines' rule. `auto_sizes` names the flags
    that were auto: on CUDA the start-up plan re-plans them to the largest that fits (`miles.plan.auto`)."""
    out: dict[str, object] = {"auto_sizes": tuple(dest for dest in AUTO_SIZED if getattr(args, dest) == AUTO)}
    if args.micro_batch_size == AUTO:
        out["micro_batch_size"] = CPU_MICRO_BATCH_SIZE
    if args.gradient_checkpointing == AUTO:
        out["gradient_checkpointing"] = False
    return out
