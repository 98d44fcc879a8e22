"""The planner's flags (`--plan` and what it plans against; miles/plan/)."""

from __future__ import annotations

import argparse

DEFAULT_PLAN_TFLOPS = 400.0  # sustained bf16 TFLOP/s per GPU: ~40% of an H100 SXM's dense peak
DEFAULT_PLAN_INTERCONNECT_GBPS = 400.0  # Gbit/s for the weight sync: one NDR InfiniBand link


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
