"""The weight export's gather at dp >= 2, side by side: torch's per-tensor full state dict (one all-gather per
tensor) vs miles' bucketed one (`gather.bucketed_full_state_dict`: one all-gather per bucket), on the same FSDP2
transformer, interleaved; checks that both give the same bits and prints the medians and the ratio. Then what the
verified sync adds: the bucketed gather with the trainer's checksums (`miles.utils.weight_checksum`), and on the
engine side the load (`load_state_dict` into an unsharded transformer) against the verification of what it loaded.

    python benchmarks/bench_weight_sync.py                          # the tiny pipeline, 2 gloo ranks on CPU
    python benchmarks/bench_weight_sync.py --hf-checkpoint DIR --world-size 4 --repeats 5
    python benchmarks/bench_weight_sync.py --sd3-size 12,12,64 --repeats 3   # a 250M-parameter SD3 transformer
    python benchmarks/bench_weight_sync.py --whole-sync --sd3-size 12,16,64 --repeats 3   # 445M, dp 2, 2 engines

`--whole-sync` times the whole sync instead (gather to engine parameters, full fine-tuning, fp32), every side a Ray
actor as in a run, interleaved: the object-store path used before (rank 0's bucketed gather returned as a pickled
dict, each engine's `update_weights`) against the sync group (`miles.weight_sync`: on one host every rank writes its
shard rows into the shared buckets, each engine copies them into its parameters in place and verifies their
checksums), and one memcpy of the same bytes in trainer rank 0's process; GB/s of the model's bytes and the ratios.
`--skip-object-store` leaves the old leg out where its memory (the model ~5 times over on rank 0) does not fit.
`--layout slots` runs the sync group over two bucket slots each engine copies out of, as before the resident layout
(the default: the engines' parameters are views of the shared file the ranks write); the memcpy is taken in every
round beside the legs. After every leg each actor hands its freed memory back to the kernel (untimed), so the
object-store leg's dicts of one round do not stay beside the next round's.

`--sd3-size LAYERS,HEADS,HEAD_DIM` builds an SD3-architecture pipeline of that transformer size (random weights,
`miles.models.sd3.tiny`) in a temporary folder first, for the gather at sizes nearer real ones without a download.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402
import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # noqa: E402

from miles.backends.fsdp_utils.fsdp import apply_fsdp2  # noqa: E402
from miles.backends.fsdp_utils.gather import bucketed_full_state_dict  # noqa: E402
from miles.backends.fsdp_utils.weight_push import WeightPusher, sync_plan  # noqa: E402
from miles.models.base import get_train_pipeline_config  # noqa: E402
from miles.models.builtin import resolve_checkpoint  # noqa: E402
from miles.ray.engine_group import ENGINE_ACTOR_OPTIONS, EngineActor  # noqa: E402
from miles.ray.placement_group import actor_nodes  # noqa: E402
from miles.utils.distributed import destroy_process_group, find_free_port, init_process_group  # noqa: E402
from miles.utils.heap import TRAINER_MMAP_THRESHOLD, keep_freed_memory  # noqa: E402
from miles.utils.weight_checksum import verify_loaded  # noqa: E402
from miles.weight_sync.protocol import DEFAULT_BUCKET_BYTES  # noqa: E402
from miles.weight_sync.transports import TransportSpec, choose_transport  # noqa: E402


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


SYNC_TIMEOUT = 1800.0


def trim_heap() -> None:
    """Hand freed memory back to the kernel (glibc): between the rounds of `--whole-sync`, outside the timings. The
    object-store leg's dicts (rank 0's gathered one, each engine's unpickled one) stay in the actors' heaps after a
    sync (`miles.utils.heap` keeps freed memory on purpose), and at 445M two engines' second sync then ran the 24 GB
    machine out of memory even with nothing else running (2026-12-07)."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


class BenchEngine(EngineActor):
    """A rollout engine actor as a run starts it, which the bench can also ask to trim its heap."""

    def trim(self) -> None:
        trim_heap()


class BenchRank:
    """One FSDP2 trainer rank holding its shards, exporting as the trainer actor does (full fine-tuning, fp32)."""

    def __init__(self, rank: int, world_size: int, checkpoint: str, master: tuple[str, int]) -> None:
        torch.set_num_threads(1)
        keep_freed_memory(TRAINER_MMAP_THRESHOLD)  # as a trainer rank on CPU does (miles.utils.heap)
        self.rank = rank
        init_process_group(rank, world_size, *master, "cpu", timeout=timedelta(seconds=SYNC_TIMEOUT))
        family = get_train_pipeline_config(checkpoint)
        self.model = family.load_transformer(checkpoint, dtype=torch.float32)
        blocks = family.transformer_blocks(self.model)
        apply_fsdp2(self.model, blocks, param_dtype=torch.float32, reduce_dtype=torch.float32)
        self.pusher: WeightPusher | None = None

    def ready(self) -> bool:
        return True

    def trim(self) -> None:
        trim_heap()

    def export_old(self) -> tuple[dict | None, dict | None]:
        checksums: dict = {}
        state = bucketed_full_state_dict(self.model, checksums=checksums)
        return (state, checksums) if self.rank == 0 else (None, None)

    def prepare(self, kind: str, bucket_bytes: int, direct: bool, resident: bool):
        self.pusher = WeightPusher(sync_plan(self.model, bucket_bytes), self.rank, torch.device("cpu"))
        return self.pusher.plan, self.pusher.prepare(kind, direct, resident), self.pusher.offsets

    def open(self, spec: TransportSpec) -> None:
        self.pusher.open(spec)

    def push(self) -> float:
        return self.pusher.push(self.model)

    def memcpy(self, nbytes: int, repeats: int) -> list[float]:
        """One copy of `nbytes` between two buffers of this process (made once: the bench calls it every round),
        `repeats` times after a warm-up."""
        if getattr(self, "copy_buffers", None) is None or self.copy_buffers[0].numel() != nbytes:
            self.copy_buffers = (torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8))
        source, target = self.copy_buffers
        target.copy_(source)
        seconds = []
        for _ in range(repeats):
            started = time.perf_counter()
            target.copy_(source)
            seconds.append(time.perf_counter() - started)
        return seconds


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def whole_sync(opts: argparse.Namespace) -> dict:
    """Start the ranks and engines, run the legs interleaved; medians and the bytes of one sync."""
    root = str(Path(__file__).resolve().parents[1])  # the workers import this checkout's miles
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = {"PYTHONPATH": path, "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    ray.init(
        num_cpus=2 * opts.world_size + opts.engines,
        include_dashboard=False,
        runtime_env={"env_vars": env},
        log_to_driver=False,
    )
    try:
        master = ("127.0.0.1", find_free_port())
        remote_rank = ray.remote(num_cpus=1)(BenchRank)
        ranks = [remote_rank.remote(r, opts.world_size, opts.hf_checkpoint, master) for r in range(opts.world_size)]
        ray.get([r.ready.remote() for r in ranks], timeout=SYNC_TIMEOUT)
        engine = ray.remote(num_cpus=0.5, **ENGINE_ACTOR_OPTIONS)(BenchEngine)
        engines = []
        for _ in range(opts.engines):  # one at a time: the load peaks do not add up (issue 48 item 6)
            engines.append(engine.remote(opts.hf_checkpoint, device="cpu"))
            ray.get(engines[-1].health.remote(), timeout=SYNC_TIMEOUT)
        kind = choose_transport(actor_nodes(ranks[:1])[0], actor_nodes(engines), "cpu")
        resident = kind == "shm" and opts.layout == "resident"
        prepared = ray.get(
            [r.prepare.remote(kind, opts.bucket_mb << 20, kind == "shm", resident) for r in ranks], timeout=SYNC_TIMEOUT
        )
        plan, opener, offsets = prepared[0]
        spec = TransportSpec(
            kind, "127.0.0.1", find_free_port(), 1 + len(engines), plan.buffer_bytes, SYNC_TIMEOUT, opener, offsets
        )
        if resident and offsets is None:
            print("/dev/shm lacks the room for the resident layout: two slots", flush=True)
        kind += ", resident" if offsets is not None else ", two slots"
        joined = [ranks[0].open.remote(spec)] + [
            e.open_weight_sync.remote(spec, plan, i + 1) for i, e in enumerate(engines)
        ]
        ray.get(joined, timeout=SYNC_TIMEOUT)
        version = iter(range(1, 1000))

        def old() -> None:
            refs = [r.export_old.options(num_returns=2).remote() for r in ranks]
            v = next(version)
            ray.get(
                [e.update_weights.remote(refs[0][0], v, refs[0][1]) for e in engines] + [p[0] for p in refs[1:]],
                timeout=SYNC_TIMEOUT,
            )

        def trim() -> None:  # after every leg, untimed: each round starts from the same heaps
            ray.get([actor.trim.remote() for actor in [*ranks, *engines]], timeout=SYNC_TIMEOUT)

        def new() -> None:
            v = next(version)
            ray.get(
                [r.push.remote() for r in ranks] + [e.receive_weights.remote(v) for e in engines], timeout=SYNC_TIMEOUT
            )

        def memcpy() -> None:  # in rank 0's process, timed there
            seconds["memcpy"].append(ray.get(ranks[0].memcpy.remote(plan.total_bytes, 1), timeout=SYNC_TIMEOUT)[0])

        legs = {f"sync group ({kind})": new, "object store (before)": old}
        if opts.skip_object_store:  # its rank 0 holds the model ~5 times over: it may not fit beside other jobs
            del legs["object store (before)"]
        # each time printed as it is taken: what was measured stays on record if the machine's memory runs out
        # in a later sync (Ray then ends a worker: the object-store leg holds the model several times over); the
        # memcpy taken in every round, beside the legs, under the same load
        seconds = {name: [] for name in ["memcpy", *legs]}
        for name, fn in legs.items():
            print(f"{name} (warm-up): {_timed(fn):.3f} s", flush=True)
            trim()
        for _ in range(opts.repeats):
            memcpy()
            print(f"memcpy: {seconds['memcpy'][-1]:.3f} s", flush=True)
            for name, fn in legs.items():
                seconds[name].append(_timed(fn))
                print(f"{name}: {seconds[name][-1]:.3f} s", flush=True)
                trim()
        return {"seconds": seconds, "bytes": plan.total_bytes, "buckets": len(plan.buckets), "kind": kind}
    finally:
        ray.shutdown()


def report_whole_sync(opts: argparse.Namespace, result: dict) -> None:
    nbytes, parameters = result["bytes"], result["bytes"] // 4
    print(
        f"whole sync: {parameters / 1e6:.0f}M parameters ({nbytes / 1e9:.2f} GB fp32), dp {opts.world_size}, "
        f"{opts.engines} engines, {result['buckets']} buckets of <= {opts.bucket_mb} MiB, {opts.repeats} interleaved repeats"
    )
    medians = {name: statistics.median(times) for name, times in result["seconds"].items()}
    for name, median in medians.items():
        print(
            f"{name:<28}{median:>9.3f} s median{min(result['seconds'][name]):>9.3f} s best{nbytes / median / 1e9:>8.2f} GB/s"
        )
    new = medians[f"sync group ({result['kind']})"]
    old = (
        f"object store / sync group = {medians['object store (before)'] / new:.1f}x; "
        if not opts.skip_object_store
        else ""
    )
    print(f"{old}sync group / memcpy = {new / medians['memcpy']:.2f}x")


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
    parser.add_argument(
        "--whole-sync", action="store_true", help="time the whole sync (gather to engine parameters) instead, in Ray"
    )
    parser.add_argument("--engines", type=int, default=2, help="--whole-sync: rollout engines")
    parser.add_argument(
        "--skip-object-store", action="store_true", help="--whole-sync: leave out the object-store leg (its memory)"
    )
    parser.add_argument(
        "--layout",
        choices=("resident", "slots"),
        default="resident",
        help="--whole-sync over shm: the engines' parameters in the shared file (a run's default) or two bucket slots "
        "each engine copies out of (as before 2026-12-06 session 9)",
    )
    opts = parser.parse_args()
    opts.hf_checkpoint = resolve_checkpoint(opts.hf_checkpoint)
    with tempfile.TemporaryDirectory() as tmp:
        if opts.sd3_size:
            from miles.models.sd3.tiny import save_tiny_sd3_pipeline

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
        if opts.whole_sync:
            opts.bucket_mb = DEFAULT_BUCKET_BYTES["cpu"] >> 20 if opts.bucket_mb is None else opts.bucket_mb
            report_whole_sync(opts, whole_sync(opts))
            return
        out = os.path.join(tmp, "rank0.pt")
        mp.spawn(rank_body, args=(opts, find_free_port(), out), nprocs=opts.world_size, join=True)
        report_gather(opts, torch.load(out))


def report_gather(opts: argparse.Namespace, report: dict) -> None:
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
