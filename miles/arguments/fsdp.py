"""Flags of sharding, precision, memory and compilation: activation checkpointing, master dtype, CPU offload, hybrid
sharding, deterministic mode, `--compile`; what `auto` resolves to, and their rules (checked by `validate_args` before
any actor starts)."""

from __future__ import annotations

import argparse
from typing import Any

from miles.algorithms import algorithm_of
from miles.arguments.plan import AUTO, parse_on_off_auto

DTYPE_CHOICES = ("fp32", "bf16", "fp16")
COMPILE_CHOICES = ("off", "blocks", "full")  # miles.models.compile.COMPILE_MODES (not imported here: torch)


def add_fsdp_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sharding, precision and memory")
    group.add_argument(
        "--diffusion-forward-dtype",
        default="auto",
        choices=("auto", *DTYPE_CHOICES),
        help="Dtype of every forward, trainer and rollout engines alike (FSDP2 param dtype; fp16 is refused). "
        "auto: bf16 when the run is on CUDA (with --diffusion-recompute-old-log-prob turned on for losses that take "
        "a policy ratio), fp32 on CPU.",
    )
    group.add_argument(
        "--gradient-checkpointing",
        nargs="?",
        const=True,
        default=AUTO,
        type=parse_on_off_auto,
        metavar="{on,off,auto}",
        help="Recompute each transformer block's activations in backward: activation memory down to the blocks' "
        "inputs, for about one more forward per step (docs/user-guide/memory.md). Given alone: on. auto: off on "
        "CPU; on CUDA on only when the start-up plan finds no micro-batch that fits without it.",
    )
    group.add_argument(
        "--compile",
        default="off",
        choices=COMPILE_CHOICES,
        help="torch.compile the transformer, in the trainer ranks and the rollout engines alike (the same function "
        "on both sides). blocks: each transformer block in place (identical blocks share one compiled code; names "
        "and checkpoint keys unchanged); full: the whole forward (--dp-size 1 only). Compiling costs tens of seconds "
        "per process on CPU, cached in TORCHINDUCTOR_CACHE_DIR across runs (docs/user-guide/performance.md).",
    )
    group.add_argument(
        "--fsdp-reduce-dtype", default="fp32", choices=DTYPE_CHOICES, help="FSDP gradient reduce dtype (not fp16)."
    )
    group.add_argument(
        "--fsdp-master-dtype",
        default="fp32",
        choices=("fp32", "bf16"),
        help="Dtype of the sharded parameters the optimizer updates (and of its moments); forwards cast them to "
        "--diffusion-forward-dtype. bf16 halves the state, and small updates round away.",
    )
    group.add_argument(
        "--fsdp-cpu-offload",
        action="store_true",
        help="FSDP2 CPUOffloadPolicy: sharded parameters, gradients and optimizer state in CPU memory, each block "
        "copied to the GPU for its forward and backward (CUDA only).",
    )
    group.add_argument(
        "--deterministic-mode",
        action="store_true",
        help="Trainer ranks use deterministic kernels only and fixed reduction orders (cuBLAS workspace, NCCL "
        "ring); slower on GPU, and an op without a deterministic kernel raises (docs/user-guide/memory.md).",
    )
    add_mesh_arguments(group)


def add_mesh_arguments(group: argparse._ArgumentGroup) -> None:
    """How a role's ranks are laid out: hybrid sharding groups and sequence parallelism."""
    group.add_argument(
        "--fsdp-shard-size",
        type=int,
        default=None,
        help="Hybrid sharding: shard within groups of N ranks (e.g. a node's GPUs), replicate across the groups "
        "(a 2-D mesh; N must divide --dp-size x --sp-size; default: shard over every rank).",
    )
    group.add_argument(
        "--fsdp-strict-shard-groups",
        action="store_true",
        help="Refuse to start when a --fsdp-shard-size group's ranks sit on more than one node (default: warn; "
        "such a group all-gathers every block over the network).",
    )
    group.add_argument(
        "--sp-size",
        type=int,
        default=1,
        help="Ulysses sequence parallelism in the trainer: each group of N consecutive ranks trains the same pairs, "
        "each rank running the transformer blocks on 1/N of every sample's tokens (attention on all tokens of 1/N "
        "of the heads). A role then has --dp-size x --sp-size ranks; FSDP2 shards over all of them. Families that "
        "declare support only (wan, ltx2, hunyuan-video15); N must divide the attention heads and the latent tokens "
        "per sample. The rollout engines stay whole (docs/user-guide/video.md).",
    )


def trainer_world_size(args: argparse.Namespace) -> int:
    """Ranks of one trained role: --dp-size data-parallel groups of --sp-size sequence-parallel ranks each."""
    ranks: int = args.dp_size * args.sp_size
    return ranks


def device_defaults(args: argparse.Namespace, cluster_gpus: float) -> dict[str, Any]:
    """What `--device auto` and `--diffusion-forward-dtype auto` resolve to on a cluster with `cluster_gpus` GPUs:
    cuda when it has any, and then a bf16 forward (fp32 matmuls are several times slower on GPUs, and fp32 engines
    hold twice the memory) with the log-prob recompute a policy ratio needs in bf16; cpu and fp32 otherwise."""
    out: dict[str, Any] = {}
    device = args.device
    if device == "auto":
        device = out["device"] = "cuda" if cluster_gpus > 0 else "cpu"
    if args.diffusion_forward_dtype == "auto":
        out["diffusion_forward_dtype"] = "bf16" if device == "cuda" else "fp32"
        if out["diffusion_forward_dtype"] == "bf16" and algorithm_of(args).log_prob_ratio:
            out["diffusion_recompute_old_log_prob"] = True
    return out


def local_device_defaults(args: argparse.Namespace) -> dict[str, Any]:
    """`device_defaults` from this machine's GPUs when the run starts its own cluster; with --ray-address they wait
    for the driver (its node may have no GPU while the cluster's nodes do): `resolve_cluster_device`. A `--plan` is
    made for GPUs (`--device auto` plans a CUDA run; a plan needs none)."""
    if args.plan:
        return device_defaults(args, 1.0)
    return {} if args.ray_address is not None else device_defaults(args, _local_gpus())


def resolve_device_defaults(args: argparse.Namespace, cluster_gpus: float) -> None:
    vars(args).update(device_defaults(args, cluster_gpus))


def resolve_cluster_device(args: argparse.Namespace, cluster_gpus: float) -> None:
    """The driver's step for --ray-address runs once Ray is up: the `auto` device and dtype from the cluster's GPUs,
    then the precision rules that waited for them (a broken rule raises ValueError naming the flags)."""
    resolve_device_defaults(args, cluster_gpus)
    errors = precision_rules(args)
    if errors:
        raise ValueError("; ".join(errors))


def sharding_rules(args: argparse.Namespace) -> list[str]:
    """Hybrid sharding's and sequence parallelism's rules (≥ 1 is checked with the other ranges; the family's own
    --sp-size rules, heads and tokens, at start-up: `TrainPipelineConfig.sequence_parallel_problems`)."""
    errors = []
    shard, world = args.fsdp_shard_size, trainer_world_size(args)
    if shard is not None and world % shard != 0:
        errors.append(
            f"--fsdp-shard-size {shard} must divide the trainer's ranks, --dp-size x --sp-size = {world} (ranks per "
            "model copy)"
        )
    if args.sp_size > 1 and args.colocate:
        errors.append(
            f"--sp-size {args.sp_size} with --colocate: colocation places one rank of each group per GPU bundle of "
            "--dp-size; sequence-parallel groups are not placed there yet. Drop --colocate or use --sp-size 1"
        )
    if args.compile == "full" and world > 1:
        errors.append(
            f"--compile full needs one trainer rank (got --dp-size x --sp-size = {world}): with several FSDP2 gathers "
            "each block's shards in hooks around the block, which break a whole-transformer graph into per-block "
            "pieces anyway; use --compile blocks, which compiles inside the per-block groups"
        )
    if args.compile != "off" and args.sp_size > 1:
        errors.append(
            f"--compile {args.compile} with --sp-size {args.sp_size}: the sequence-parallel attention's all-to-alls "
            "inside compiled blocks are not checked yet; use --compile off with --sp-size > 1"
        )
    if args.compile == "full" and args.gradient_checkpointing is True:
        errors.append(
            "--compile full with --gradient-checkpointing: the per-block recompute hooks would be traced into the "
            "whole-transformer graph; use --compile blocks (checkpointing wraps the compiled blocks)"
        )
    return errors


def precision_rules(args: argparse.Namespace) -> list[str]:
    """The dtype and offload rules, once the device and dtype are known (still `auto`: none yet)."""
    if args.device == "auto" or args.diffusion_forward_dtype == "auto":
        return []
    errors = [
        f"--{dest.replace('_', '-')} fp16 is not supported: fp16 gradients need a sharded gradient scaler, which miles "
        "does not have (small gradients would underflow to zero, silently); use bf16"
        for dest in ("diffusion_forward_dtype", "fsdp_reduce_dtype")
        if getattr(args, dest) == "fp16"
    ]
    ratio = algorithm_of(args).log_prob_ratio
    if args.diffusion_forward_dtype != "fp32" and ratio and not args.diffusion_recompute_old_log_prob:
        errors.append(
            f"--diffusion-forward-dtype {args.diffusion_forward_dtype} with --loss-type {args.loss_type} requires "
            "--diffusion-recompute-old-log-prob: the engines sample in the same dtype, but bf16 forwards differ by "
            "rounding between batch shapes and sharding (one bf16 ulp of the velocity, ~1e-4 in log-prob), which "
            "--diffusion-clip-range would clip; the recompute makes the first ratio exactly 1"
        )
    if args.fsdp_master_dtype == "bf16" and args.diffusion_forward_dtype == "fp32":
        errors.append(
            "--fsdp-master-dtype bf16 with --diffusion-forward-dtype fp32 stores less precision than it computes "
            "in: use --diffusion-forward-dtype bf16 (or keep fp32 master weights)"
        )
    if args.fsdp_cpu_offload and args.device != "cuda":
        errors.append(
            "--fsdp-cpu-offload moves GPU state to CPU memory: it needs CUDA (--device cuda, or auto with a GPU); "
            "on CPU the state is in CPU memory already"
        )
    return errors


def _local_gpus() -> int:
    import torch  # only when a run is validated, not to parse --help

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
