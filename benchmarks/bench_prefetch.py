"""Micro-batch prefetch (`--prefetch-microbatches`), side by side in one run: the real trunk (a `RayTrainGroup` rank,
its `TrainLoop` and `MicrobatchPrefetcher`) with an expensive prepare hook, prefetch off and on, interleaved.

Both sides are trainer groups of the same tiny model built in one Ray cluster; every repeat gives both the same
pairs (each side first in turn). The prepare hook is SFT's prepare plus a known cost per micro-batch:

- `sleep` (default): `time.sleep(cost)`. It models host work that releases the GIL and needs no core of the
  trainer's: reading and decoding a batch from disk or a data service, waiting for a host-to-device copy. This is
  what the prefetcher is for, and on a small shared CPU machine it measures the overlap itself rather than how many
  cores are free.
- `python`: a pure-Python busy loop of `cost` seconds, holding the GIL (Python-heavy host work: tokenising,
  building captions). Only what the trunk runs outside the GIL (torch's kernels) can overlap it, so expect less.

Reported per side: the training loop's time per train call (the windows' `perf/train_step_s`, summed; median and
best of the timed calls), the prepare hook's own time (measured inside it), and the fraction of prepare time hidden
= (t_off - t_on) / prepare time, from the medians and as the median over repeats of each repeat's two calls (back
to back, so a neighbour's load drifting between repeats cancels). A window's first prepare has nothing to overlap
(prefetch never crosses a window: the optimizer step between windows changes the weights a prepare may read), so
at most (M - 1) / M of it can be hidden with M micro-batches per window, and only while one micro-batch's forward
and backward take at least one prepare. The run also checks that both sides' loss series and final weights are
bit-identical, and prints it.

    python benchmarks/bench_prefetch.py              # 32 pairs, 2 windows of 8 micro-batches of 2, 10 ms sleep
    python benchmarks/bench_prefetch.py --prepare-ms 50 --repeats 9 --prepare-kind python
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from miles.utils.console import WORKER_ENV  # noqa: E402

for name, value in WORKER_ENV.items():  # no loading bars from the driver's text encoders, as in Ray workers
    os.environ.setdefault(name, value)

import torch  # noqa: E402

from miles.backends.fsdp_utils.loss_hub import sft  # noqa: E402

HERE = os.path.abspath(__file__)
SIDES = ("off", "on")
PREPARE_SECONDS: list[float] = []  # in the trainer rank's process: each prepare call's seconds, for train_output


def spend(seconds: float, kind: str) -> None:
    """`seconds` of the expensive part of a prepare: asleep (GIL released) or in a Python loop (GIL held)."""
    if kind == "sleep":
        time.sleep(seconds)
        return
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def prepare(ctx, batch, *, microbatch_id, optim_step_idx, pad_to_len=None):
    """The custom prepare hook: SFT's prepare (same noise, seeded by the ids) plus the benchmark's cost."""
    started = time.perf_counter()
    prepared = sft.prepare_sft_batch(ctx, batch, microbatch_id=microbatch_id, optim_step_idx=optim_step_idx)
    spend(ctx.args.bench_prepare_s, ctx.args.bench_prepare_kind)
    PREPARE_SECONDS.append(time.perf_counter() - started)
    return prepared


def train_output(ctx, train_pairs, train_output_inputs):
    """The prepare calls' seconds of this train call, for the driver."""
    seconds = list(PREPARE_SECONDS)
    PREPARE_SECONDS.clear()
    return {"prepare_s": seconds}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf-checkpoint", default="builtin:tiny-shapes")
    parser.add_argument("--pairs", type=int, default=32, help="train pairs per train call (one rank)")
    parser.add_argument("--windows", type=int, default=2, help="optimizer steps per train call")
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--prepare-ms", type=float, default=10.0, help="the prepare hook's cost per micro-batch")
    parser.add_argument("--prepare-kind", choices=("sleep", "python"), default="sleep")
    parser.add_argument("--repeats", type=int, default=9, help="timed train calls per side, interleaved")
    opts = parser.parse_args(argv)
    if opts.pairs < 1 or opts.windows < 1 or opts.pairs % opts.windows:
        parser.error(f"--pairs {opts.pairs} must be a positive multiple of --windows {opts.windows}")
    if opts.micro_batch_size < 1 or opts.prepare_ms < 0 or opts.repeats < 1:
        parser.error("--micro-batch-size and --repeats must be >= 1, --prepare-ms >= 0")
    return opts


def trainer_args(opts: argparse.Namespace, mode: str) -> argparse.Namespace:
    """One rank of custom_loss = SFT with this file's prepare, --prefetch-microbatches `mode`."""
    from miles.arguments.parser import parse_args as miles_args

    args = miles_args(
        [
            *("--hf-checkpoint", opts.hf_checkpoint, "--prompt-data", "builtin:shapes", "--train-only"),
            *("--loss-type", "custom_loss", "--custom-prepare-train-batch-path", f"{HERE}:prepare"),
            *("--custom-loss-function-path", "miles.backends.fsdp_utils.loss_hub.sft.sft_formula"),
            *("--custom-train-output-path", f"{HERE}:train_output"),
            *("--n-samples-per-prompt", "1", "--rollout-batch-size", str(opts.pairs), "--dp-size", "1"),
            *("--num-steps-per-rollout", str(opts.windows), "--micro-batch-size", str(opts.micro_batch_size)),
            *("--num-rollout", str(opts.repeats + 1), "--lr", "1e-3", "--log-level", "WARNING"),
            *("--prefetch-microbatches", mode),
        ]
    )
    args.bench_prepare_s, args.bench_prepare_kind = opts.prepare_ms / 1000, opts.prepare_kind  # read by `prepare`
    return args


def make_pairs(family, n: int, seed: int) -> dict[str, torch.Tensor]:
    """n SFT pairs (clean latents and their prompts' embeddings), the same for both sides."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [f"{['one', 'two', 'three'][i % 3]} red circles on the left" for i in range(n)]
    x0 = torch.randn((n, *family.latent_shape()), generator=gen)
    return {"x0": x0, **family.encode_prompts(prompts).to(dtype=torch.float32).to_columns()}


def train_call(group, rollout_id: int, pairs: dict) -> dict:
    """One train call: the windows' seconds and losses (metrics), the prepares' seconds (train output), wall."""
    from miles.utils.box import put_box
    from miles.utils.types import shard_pairs

    started = time.perf_counter()
    output = group.train(rollout_id, [put_box(shard_pairs(pairs, 1)[0])])[0].get(timeout=600)  # + pair_index
    wall = time.perf_counter() - started
    records = group.pop_metrics()
    return {
        "wall_s": wall,
        "step_s": sum(r["perf/train_step_s"] for r in records),
        "losses": [r["train/loss"] for r in records],
        "prepare_s": sum(output["prepare_s"]),
        "prepares": len(output["prepare_s"]),
    }


def run_sides(opts: argparse.Namespace) -> dict:
    """Both groups built, one warm-up call each, then `repeats` interleaved timed calls; their final weights."""
    from miles.models.base import get_train_pipeline_config
    from miles.ray.train_group import RayTrainGroup

    family = get_train_pipeline_config(opts.hf_checkpoint)
    family.load_text_encoders()
    groups = {mode: RayTrainGroup(trainer_args(opts, mode), "actor", timeout=600) for mode in SIDES}
    calls: dict[str, list[dict]] = {mode: [] for mode in SIDES}
    try:
        for group in groups.values():
            group.start_init()
        for group in groups.values():
            group.finish_init()
        for rollout_id in range(opts.repeats + 1):
            pairs = make_pairs(family, opts.pairs, seed=rollout_id)
            order = SIDES if rollout_id % 2 == 0 else SIDES[::-1]  # each side first in turn
            for mode in order:
                calls[mode].append(train_call(groups[mode], rollout_id, pairs))
        weights = {mode: group.call("full_state_dict_every_rank")[0] for mode, group in groups.items()}
    finally:
        for group in groups.values():
            group.shutdown()
    return {"calls": {mode: c[1:] for mode, c in calls.items()}, "warmup": calls, "weights": weights}


def bit_identical(result: dict) -> bool:
    """Every window's loss (warm-up included) and every final weight the same bits with prefetch off and on."""
    off, on = (result["warmup"][mode] for mode in SIDES)
    same_losses = [c["losses"] for c in off] == [c["losses"] for c in on]
    a, b = (result["weights"][mode] for mode in SIDES)
    return same_losses and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def main(argv: list[str] | None = None) -> dict:
    import ray

    from miles.models.builtin import resolve_checkpoint

    opts = parse_args(argv)
    opts.hf_checkpoint = resolve_checkpoint(opts.hf_checkpoint)
    own_ray = not ray.is_initialized()
    if own_ray:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        result = run_sides(opts)
    finally:
        if own_ray:
            ray.shutdown()
    per_window = -(-(opts.pairs // opts.windows) // opts.micro_batch_size)
    medians = {
        mode: {
            key: statistics.median(c[key] for c in result["calls"][mode]) for key in ("wall_s", "step_s", "prepare_s")
        }
        for mode in SIDES
    }
    best = {mode: min(c["step_s"] for c in result["calls"][mode]) for mode in SIDES}  # the least disturbed call
    prepares = result["calls"]["off"][0]["prepares"]
    prepare_total = medians["off"]["prepare_s"]
    hidden = (medians["off"]["step_s"] - medians["on"]["step_s"]) / prepare_total if prepare_total > 0 else 0.0
    pairs = zip(result["calls"]["off"], result["calls"]["on"])  # the two calls of one repeat ran back to back
    hidden_paired = statistics.median(
        (off["step_s"] - on["step_s"]) / off["prepare_s"] if off["prepare_s"] > 0 else 0.0 for off, on in pairs
    )
    compute = (medians["off"]["step_s"] - prepare_total) / prepares
    same = bit_identical(result)
    print(
        f"{opts.pairs} pairs per train call, {opts.windows} windows of {per_window} micro-batches, "
        f"{opts.prepare_kind} prepare of {opts.prepare_ms:g} ms, {opts.repeats} timed calls per side (interleaved)"
    )
    print(f"{'prefetch':<10}{'loop s':>9}{'best':>8}{'prepare s':>11}{'call wall s':>13}   (medians but best)")
    for mode in SIDES:
        m = medians[mode]
        print(f"{mode:<10}{m['step_s']:>9.3f}{best[mode]:>8.3f}{m['prepare_s']:>11.3f}{m['wall_s']:>13.3f}")
    print(
        f"per micro-batch: prepare {prepare_total / prepares * 1000:.1f} ms, forward + backward + the rest "
        f"{compute * 1000:.1f} ms"
    )
    print(
        f"prepare time hidden = (t_off - t_on) / prepare time = {hidden:.0%} from the medians, {hidden_paired:.0%} "
        f"the median over repeats (at most {(per_window - 1) / per_window:.0%}: each window's first prepare has nothing "
        "to overlap)"
    )
    if prepare_total / prepares > compute:
        print("the prepare is longer than a micro-batch's compute: only the compute's length of it can be hidden")
    print(f"loss series and final weights bit-identical off / on: {same}")
    if not same:
        sys.exit("prefetch changed the loss series or the weights")
    return {
        "medians": medians,
        "best": best,
        "hidden": hidden,
        "hidden_paired": hidden_paired,
        "bit_identical": same,
        "per_window": per_window,
    }


if __name__ == "__main__":
    main()
