"""The weight export's gather at dp >= 2, side by side: torch's per-tensor full state dict (one all-gather per
tensor) vs miles' bucketed one (`fsdp.bucketed_full_state_dict`: one all-gather per bucket), on the same FSDP2
transformer, interleaved; checks that both give the same bits and prints the medians and the ratio. Then what the
verified sync adds: the bucketed gather with the trainer's checksums (`miles.utils.weight_checksum`), and on the
engine side the load (`load_state_dict` into an unsharded transformer) against the verification of what it loaded.

    python benchmarks/bench_weight_sync.py                          # the tiny pipeline, 2 gloo ranks on CPU
    python benchmarks/bench_weight_sync.py --hf-checkpoint DIR --world-size 4 --repeats 5
    python benchmarks/bench_weight_sync.py --sd3-size 12,12,64 --repeats 3   # a 165M-parameter SD3 transformer

`--sd3-size LAYERS,HEADS,HEAD_DIM` builds an SD3-architecture pipeline of that transformer size (random weights,
`miles.models.tiny`) in a temporary folder first, for the gather at sizes nearer real ones without a download.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # noqa: E402

from miles.backends.fsdp_utils.fsdp import apply_fsdp2, bucketed_full_state_dict  # noqa: E402
from miles.models.base import get_train_pipeline_config  # noqa: E402
from miles.models.builtin import resolve_checkpoint  # noqa: E402
from miles.utils.distributed import destroy_process_group, find_free_port, init_process_group  # noqa: E402
from miles.utils.heap import keep_freed_memory  # noqa: E402
from miles.utils.weight_checksum import verify_loaded  # noqa: E402


def rank_body(rank: int, opts: argparse.Namespace, port: int, out: str) -> None:
    torch.set_num_threads(1)
    keep_freed_memory()  # as a trainer rank on CPU does (miles.utils.heap)
    init_process_group(rank, opts.world_size, "127.0.0.1", port, "cpu", timeout=timedelta(seconds=600))
    try:
        family = get_train_pipeline_config(opts.hf_checkpoint)
        model = family.load_transformer(opts.hf_checkpoint, dtype=torch.float32)
        apply_fsdp2(model, family.transformer_blocks(model), param_dtype=torch.float32, reduce_dtype=torch.float32)
        per_tensor = StateDictOptions(full_state_dict=True, cpu_offload=True)
        sides = {
            "per-tensor gather": lambda: get_model_state_dict(model, options=per_tensor),
            "bucketed gather": lambda: bucketed_full_state_dict(
                model, bucket_bytes=None if opts.bucket_mb is None else opts.bucket_mb << 20
            ),
        }
        checksums: dict = {}
        sides["bucketed gather + checksums"] = lambda: bucketed_full_state_dict(
            model, bucket_bytes=None if opts.bucket_mb is None else opts.bucket_mb << 20, checksums=checksums
        )
        results = {name: fn() for name, fn in sides.items()}  # warm-up, and the bits to compare
        seconds: dict[str, list[float]] = {name: [] for name in sides}
        for _ in range(opts.repeats):
            for name, fn in sides.items():
                torch.distributed.barrier()
                started = time.perf_counter()
                fn()
                seconds[name].append(time.perf_counter() - started)
        if rank == 0:
            a, b, _ = results.values()
            same = list(a) == list(b) and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
            parameters = sum(t.numel() for t in a.values())
            seconds.update(engine_side(family, opts, b, checksums))
            torch.save({"seconds": seconds, "same": same, "tensors": len(a), "parameters": parameters}, out)
    finally:
        destroy_process_group()


def engine_side(family, opts: argparse.Namespace, state: dict, checksums: dict) -> dict[str, list[float]]:
    """An engine's part of a sync, interleaved: loading the exported weights, and verifying what it loaded."""
    engine = family.load_transformer(opts.hf_checkpoint, dtype=torch.float32).eval()
    sides = {
        "engine load": lambda: engine.load_state_dict(state, strict=True),
        "engine verify": lambda: verify_loaded(checksums, engine.state_dict(), state, version=0),
    }
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    with torch.no_grad():
        for _ in range(opts.repeats + 1):  # the first round warms up
            for name, fn in sides.items():
                started = time.perf_counter()
                fn()
                seconds[name].append(time.perf_counter() - started)
    return {name: times[1:] for name, times in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf-checkpoint", default="builtin:tiny-shapes")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument(
        "--bucket-mb", type=int, default=None, help="bucket size per rank in MiB (default: miles' for the device)"
    )
    parser.add_argument(
        "--sd3-size", default=None, help="LAYERS,HEADS,HEAD_DIM: an SD3 transformer of that size instead of the folder"
    )
    opts = parser.parse_args()
    opts.hf_checkpoint = resolve_checkpoint(opts.hf_checkpoint)
    with tempfile.TemporaryDirectory() as tmp:
        if opts.sd3_size:
            from miles.models.tiny import save_tiny_sd3_pipeline

            try:
                layers, heads, head_dim = (int(part) for part in opts.sd3_size.split(","))
            except ValueError:
                parser.error(f"--sd3-size {opts.sd3_size!r}: give LAYERS,HEADS,HEAD_DIM, e.g. 12,12,64")
            opts.hf_checkpoint = save_tiny_sd3_pipeline(
                os.path.join(tmp, "sd3"),
                transformer_layers=layers,
                transformer_heads=heads,
                transformer_head_dim=head_dim,
            )
        out = os.path.join(tmp, "rank0.pt")
        mp.spawn(rank_body, args=(opts, find_free_port(), out), nprocs=opts.world_size, join=True)
        report = torch.load(out)
    print(
        f"{report['tensors']} tensors, {report['parameters'] / 1e6:.1f}M parameters, {opts.world_size} gloo ranks, "
        f"{opts.repeats} interleaved repeats"
    )
    medians = {name: statistics.median(times) for name, times in report["seconds"].items()}
    for name, median in medians.items():
        print(f"{name:<30}{median * 1000:>10.1f} ms median{min(report['seconds'][name]) * 1000:>10.1f} ms best")
    per_tensor, bucketed = medians["per-tensor gather"], medians["bucketed gather"]
    print(f"ratio per-tensor / bucketed = {per_tensor / bucketed:.2f}  (bit-identical: {report['same']})")
    trainer = medians["bucketed gather + checksums"] - bucketed
    sync = bucketed + medians["engine load"]
    print(
        f"checksums: trainer +{trainer * 1000:.1f} ms, engine verify {medians['engine verify'] * 1000:.1f} ms; "
        f"(trainer + verify) / (gather + load) = {(trainer + medians['engine verify']) / sync:.2f}"
    )
    if not report["same"]:
        sys.exit("the bucketed gather differs from the per-tensor one")


if __name__ == "__main__":
    main()
