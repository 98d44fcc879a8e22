"""Peak memory of a trainer rank above its baseline, through miles' own trainer (`FSDPTrainRayActor`, called without
Ray): the tiny SD3 pipeline with a real-size transformer (`miles.models.sd3.tiny`, random weights; its tiny text
encoders and VAE), LoRA DiffusionNFT at dp 2 on CPU gloo ranks, one rollout's training per `--rollouts`.

    python benchmarks/bench_trainer_memory.py                      # 12 layers x 16 heads x 64: 461M parameters
    python benchmarks/bench_trainer_memory.py --layers 4           # a smaller model, same path

Memory is each rank's resident set (Linux /proc, after `malloc_trim`), above its baseline: the rank's imports, before
the process group and any weight. Reported per rank: the load peak (init: process group, sharded load, LoRA,
optimizer), what stays after init, and the peak over `train_pairs` (the old-policy forward, the policy forward and
backward, AdamW, the shadow update), each also as a multiple of the rank's share of the fp32 weights (the full model
/ dp), and the phase of the training step where the peak was reached (sampled every 10 ms). Not a timed test.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_memory import reset_peak, rss, trimmed_rss  # noqa: E402

from miles.models.sd3.tiny import save_tiny_sd3_pipeline  # noqa: E402
from miles.utils.distributed import find_free_port  # noqa: E402

GIB = 2**30
PARTS = ("VmRSS", "RssAnon", "RssFile")  # the resident set, its anonymous memory (heap, tensors), its file pages (code)


def rss_parts() -> dict[str, int]:
    """PARTS from one read of /proc/self/status, in bytes."""
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return {name: int(fields[name].split()[0]) * 1024 for name in PARTS}


class PhaseSampler:
    """Samples the resident set every 10 ms in a thread; `phase` names what the rank is doing (set by the wrappers)."""

    def __init__(self) -> None:
        self.phase, self.peak, self.peak_phase = "idle", 0, "idle"
        self.peak_parts: dict[str, int] = {}  # PARTS at the highest sample
        self.by_phase: dict[str, int] = {}  # the highest resident set sampled in each phase
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            parts, phase = rss_parts(), self.phase
            now = parts["VmRSS"]
            self.by_phase[phase] = max(now, self.by_phase.get(phase, 0))
            if now > self.peak:
                self.peak, self.peak_phase, self.peak_parts = now, phase, parts

    def __enter__(self) -> PhaseSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def wrap(self, owner: object, name: str, label: str) -> None:
        original = getattr(owner, name)

        def wrapped(*args, **kwargs):
            previous, self.phase = self.phase, label
            try:
                return original(*args, **kwargs)
            finally:
                self.phase = previous

        setattr(owner, name, wrapped)


def trainer_args(folder: str, opts: dict) -> argparse.Namespace:
    from miles.arguments.parser import parse_args

    per_rank = opts["pairs_per_rank"]
    return parse_args(
        ["--hf-checkpoint", folder, "--prompt-data", "builtin:shapes", "--loss-type", "nft"]
        + ["--device", "cpu", "--dp-size", "2", "--use-lora", "--resolution", str(opts["resolution"])]
        + ["--rollout-batch-size", str(per_rank), "--n-samples-per-prompt", "2"]
        + ["--global-batch-size", str(2 * per_rank), "--micro-batch-size", "1", "--num-steps-per-rollout", "1"]
        + ["--cpus-per-rank", str(max(1, opts["threads"] // 2)), "--log-level", "WARNING"]
        + opts["extra"]
    )


def train_pairs(family, n: int) -> dict[str, torch.Tensor]:
    """NFT's train pairs as a rollout hands them over: clean latents, a timestep and an advantage per pair."""
    gen = torch.Generator().manual_seed(0)
    prompts = [f"{['one', 'two', 'three'][i % 3]} red circles on the left" for i in range(n)]
    return {
        "x0": torch.randn(n, *family.latent_shape(), generator=gen),
        "t": torch.rand(n, generator=gen) * 0.9 + 0.05,
        "advantage": torch.randn(n, generator=gen),
        **family.encode_prompts(prompts).to(dtype=torch.float32).to_columns(),
    }


def rank_main(rank: int, port: int, opts: dict, out: str) -> None:
    from miles.backends.fsdp_utils import train_loop
    from miles.backends.fsdp_utils.actor import FSDPTrainRayActor
    from miles.backends.fsdp_utils.ema import ShadowNetwork
    from miles.models.base import get_train_pipeline_config
    from miles.utils.types import shard_pairs

    family = get_train_pipeline_config(opts["folder"])
    family.load_text_encoders()
    shard = shard_pairs(train_pairs(family, 2 * opts["pairs_per_rank"]), 2)[rank]
    del family
    args = trainer_args(opts["folder"], opts)
    actor = FSDPTrainRayActor(2, rank, "actor")
    baseline = trimmed_rss()
    baseline_parts = rss_parts()
    reset_peak()
    actor.init(args, "127.0.0.1", port)
    load_peak, loaded = rss("VmHWM") - baseline, trimmed_rss() - baseline
    sampler = PhaseSampler()
    for owner, name, label in (
        (train_loop.TrainLoop, "_prepared", "prepare"),
        (train_loop.TrainLoop, "_predict", "policy forward"),
        (ShadowNetwork, "forward", "old forward"),
        (torch.Tensor, "backward", "backward"),
        (actor.optimizer, "step", "optimizer step"),
        (train_loop, "clip_grad_norm_", "clip"),
        (train_loop.TrainLoop, "_update_shadows", "shadow update"),
    ):
        sampler.wrap(owner, name, label)
    reset_peak()
    with sampler:
        for rollout in range(opts["rollouts"]):
            actor.train_pairs(rollout, shard)
    train_peak = rss("VmHWM") - baseline
    step_s = [m["perf/train_step_s"] for m in actor.pop_metrics()] if rank == 0 else []
    actor.shutdown()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(
            {
                "baseline": baseline,
                "load_peak": load_peak,
                "loaded": loaded,
                "train_peak": train_peak,
                "peak_phase": sampler.peak_phase,
                "by_phase": {phase: peak - baseline for phase, peak in sampler.by_phase.items()},
                "peak_parts": {k: sampler.peak_parts[k] - baseline_parts[k] for k in PARTS},
                "step_s": step_s,
            },
            f,
        )


def transformer_parameters(folder: str) -> int:
    from safetensors import safe_open

    path = os.path.join(folder, "transformer", "diffusion_pytorch_model.safetensors")
    with safe_open(path, framework="pt") as f:
        return sum(torch.Size(f.get_slice(k).get_shape()).numel() for k in f.keys())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12, help="SD3 joint blocks (12 x 16 heads x 64: 461M at 256 px).")
    parser.add_argument("--heads", type=int, default=16, help="Attention heads.")
    parser.add_argument("--head-dim", type=int, default=64, help="Width of one head.")
    parser.add_argument("--resolution", type=int, default=256, help="Image side in pixels (256: 256 image tokens).")
    parser.add_argument("--pairs-per-rank", type=int, default=2, help="Train pairs per rank (micro-batches of 1).")
    parser.add_argument("--rollouts", type=int, default=2, help="train_pairs calls (the second reuses the heap).")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="Torch threads over both ranks.")
    parser.add_argument(
        "--folder", default=None, help="Build the pipeline here, or reuse the one an earlier run built."
    )
    parser.add_argument("--extra", action="append", default=[], help="More miles flags, e.g. --extra=--lora-rank=4.")
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        folder = opts.folder or os.path.join(scratch, "pipeline")
        if not os.path.exists(os.path.join(folder, "model_index.json")):
            sizes = {"transformer_layers": opts.layers, "transformer_heads": opts.heads}
            save_tiny_sd3_pipeline(folder, resolution=opts.resolution, transformer_head_dim=opts.head_dim, **sizes)
        params = transformer_parameters(folder)
        with tempfile.TemporaryDirectory() as out:
            started = time.perf_counter()
            mp.spawn(rank_main, args=(find_free_port(), {**vars(opts), "folder": folder}, out), nprocs=2)
            reports = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2)]
    print_report(params, opts, reports, time.perf_counter() - started)


def print_report(params: int, opts: argparse.Namespace, reports: list[dict], seconds: float) -> None:
    share = 4 * params / 2  # the rank's share of the fp32 weights

    def sized(value: int) -> str:
        return f"{value / GIB:.3f} GiB ({value / share:.3f}x share)"

    print(f"SD3-architecture transformer, {params / 1e6:.0f}M parameters; share {share / GIB:.2f} GiB a rank")
    print(f"LoRA nft at dp 2, {opts.resolution} px, {opts.pairs_per_rank} pairs per rank, {seconds:.0f} s")
    print("optimizer steps (rank 0), s: " + ", ".join(f"{s:.1f}" for s in reports[0]["step_s"]))
    for rank, r in enumerate(reports):
        print(
            f"rank {rank}: baseline {r['baseline'] / GIB:.2f} GiB; load peak {sized(r['load_peak'])}; after init "
            f"{sized(r['loaded'])}; train peak {sized(r['train_peak'])}, reached in: {r['peak_phase']}"
        )
        anon, files = (r["peak_parts"][k] / GIB for k in ("RssAnon", "RssFile"))
        print(f"  rank {rank}, at the highest sample above baseline, GiB: anonymous {anon:.3f}, file pages {files:.3f}")
        phases = sorted(r["by_phase"].items(), key=lambda kv: -kv[1])
        print(
            f"  rank {rank}, highest sampled in each phase, GiB: " + ", ".join(f"{p} {v / GIB:.3f}" for p, v in phases)
        )


if __name__ == "__main__":
    main()
