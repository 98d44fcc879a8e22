"""How close a plan is to the memory a process really uses: for each configuration, `--plan` (fake tensors) gives
each simulated process's peak, then the same steps run for real in fresh processes (trainer ranks at the planned
dp size over gloo, or one engine), each measuring its peak RSS above its own baseline (after its imports and its
inputs). Reported side by side, with the ratio; CPU runs (`--device cpu`, fp32), since that is what this machine
can measure.

    python benchmarks/bench_plan.py                    # the four configurations of docs/user-guide/memory.md
    python benchmarks/bench_plan.py --only sd3-lora-dp1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_memory import reset_peak, rss, trimmed_rss  # noqa: E402
from diffusers import WanTransformer3DModel  # noqa: E402

from miles.arguments.parser import parse_args  # noqa: E402
from miles.models.sd3.tiny import save_tiny_sd3_pipeline  # noqa: E402
from miles.models.tiny import save_tiny_folder  # noqa: E402
from miles.models.wan.tiny import TINY_WAN_NUM_FRAMES, TINY_WAN_RESOLUTION, build_tiny_wan_pipeline  # noqa: E402
from miles.plan.engine_sim import simulate_engine  # noqa: E402
from miles.plan.process import simulation_args  # noqa: E402
from miles.plan.run import engine_rows, simulate  # noqa: E402
from miles.plan.simulate import simulate_trainer_rank, train_pairs_for_rank  # noqa: E402
from miles.utils.distributed import find_free_port  # noqa: E402

SMALL_RUN = ["--device", "cpu", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--eval-interval", "0"]
# name -> (model, flags, what is measured)
CONFIGS = {
    "sd3-lora-dp1": ("sd3", ["--dp-size", "1", "--use-lora", "--micro-batch-size", "4"], "trainer"),
    "sd3-full-dp2": ("sd3", ["--dp-size", "2", "--micro-batch-size", "4"], "trainer"),
    "wan-ckpt-dp1": ("wan", ["--dp-size", "1", "--gradient-checkpointing", "--micro-batch-size", "2"], "trainer"),
    "sd3-engine": ("sd3", ["--dp-size", "1"], "engine"),
}


def save_models(root: str) -> dict[str, str]:
    """An SD3-architecture pipeline with a 0.44B-parameter transformer (12 layers of 16 heads x 64) and a
    Wan-architecture one with a 0.24B-parameter transformer (8 layers of 12 heads x 64), the tiny text encoders and
    VAEs of their builders, random weights."""
    sd3 = save_tiny_sd3_pipeline(
        os.path.join(root, "sd3"), transformer_layers=12, transformer_heads=16, transformer_head_dim=64
    )
    pipe = build_tiny_wan_pipeline()
    config = dict(pipe.transformer.config)
    config.update(num_attention_heads=12, attention_head_dim=64, ffn_dim=3072, num_layers=8)
    pipe.transformer = WanTransformer3DModel(**{k: v for k, v in config.items() if not k.startswith("_")}).eval()
    wan = save_tiny_folder(
        pipe, os.path.join(root, "wan"), resolution=TINY_WAN_RESOLUTION, num_frames=TINY_WAN_NUM_FRAMES
    )
    return {"sd3": sd3, "wan": wan}


def run_args(folder: str, flags: list[str]) -> argparse.Namespace:
    return parse_args(["--hf-checkpoint", folder, *SMALL_RUN, *flags])


def trainer_rank(rank: int, world: int, port: int, folder: str, flags: list[str], pairs_file: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    args = simulation_args(run_args(folder, flags))
    for steps in [k for k in vars(args) if k.endswith("num_steps_per_rollout")]:
        setattr(args, steps, 2)  # two windows: the second's forwards run beside AdamW's moments, as the plan's
    pairs = torch.load(pairs_file)
    before = trimmed_rss()
    reset_peak()
    simulate_trainer_rank(args, "actor", rank, world, pairs, fake=False, export=False)
    Path(out, f"rank{rank}.json").write_text(json.dumps({"peak": rss("VmHWM") - before}))


def engine_process(folder: str, flags: list[str], rows: int, out: str) -> None:
    torch.set_num_threads(1)
    args = simulation_args(run_args(folder, flags))
    before = trimmed_rss()
    reset_peak()
    simulate_engine(args, rows, fake=False)
    Path(out, "engine.json").write_text(json.dumps({"peak": rss("VmHWM") - before}))


def measure(name: str, folder: str, flags: list[str], what: str, tmp: str) -> dict:
    args = run_args(folder, flags)
    started = time.perf_counter()
    simulation = simulate(args, ranks=[0])
    process = simulation.engine if what == "engine" else simulation.roles["actor"][0]
    planned = max(process.peaks.get(phase, 0) for phase in ("start-up", "train", "generate"))  # not the export
    plan_s = time.perf_counter() - started
    out = tempfile.mkdtemp(dir=tmp)
    if what == "engine":
        proc = mp.get_context("spawn").Process(target=engine_process, args=(folder, flags, engine_rows(args), out))
        proc.start()
        proc.join()
        measured = json.loads(Path(out, "engine.json").read_text())["peak"]
    else:
        sim = simulation_args(args)
        _, result, samples, _ = simulate_engine(sim, max(1, sim.global_batch_size // args.dp_size), fake=False)
        pairs = train_pairs_for_rank(sim, samples, result)
        micro = args.micro_batch_size
        # two windows of two micro-batches: the second window's second micro-batch is the steady state a plan
        # estimates (beside AdamW's moments and the first micro-batch's gradients)
        pairs = {k: torch.cat([v[: 2 * micro]] * 2).clone() for k, v in pairs.items()}
        pairs_file = os.path.join(out, "pairs.pt")
        torch.save(pairs, pairs_file)
        world = args.dp_size
        mp.spawn(trainer_rank, args=(world, find_free_port(), folder, flags, pairs_file, out), nprocs=world)
        measured = json.loads(Path(out, "rank0.json").read_text())["peak"]
    return {"config": name, "planned": planned, "measured": measured, "plan_s": round(plan_s, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=None, choices=sorted(CONFIGS))
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folders = save_models(tmp)
        rows = []
        for name, (model, flags, what) in CONFIGS.items():
            if opts.only in (None, name):
                rows.append(measure(name, folders[model], flags, what, tmp))
                row = rows[-1]
                print(  # noqa: T201
                    f"{row['config']:<14} planned {row['planned'] / 2**30:7.3f} GiB  measured RSS {row['measured'] / 2**30:7.3f} GiB"
                    f"  plan/measured {row['planned'] / max(row['measured'], 1):.2f}  (plan {row['plan_s']}s)",
                    flush=True,
                )


if __name__ == "__main__":
    main()
