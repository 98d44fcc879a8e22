"""Trunk training throughput vs a plain PyTorch loop doing identical maths on the same model (ARCHITECTURE §11).

Both sides train the same transformer with the flow-matching (sft_loss) objective on the same pairs: the trunk
through a 1-rank `RayTrainGroup` (Ray actor, FSDP2, hooks, metrics), the plain loop in this process; and a second
trunk group with `--compile MODE` (compiled transformer blocks; its compile is its warm-up call, timed apart). Runs are
interleaved and the median of several repetitions is reported, as train pairs/s and the ratios trunk / plain and
compiled / eager trunk.

    python benchmarks/bench_train.py                      # the tiny pipeline, built offline
    python benchmarks/bench_train.py --hf-checkpoint DIR --pairs 64 --micro-batch-size 8 --compile off
    python benchmarks/bench_train.py --profile            # where a step's time goes, eager / blocks / full

`--profile` runs no Ray: one micro-batch's training step (forward, flow-matching loss, backward, clip, the trainer's
fused AdamW) of the same transformer in this process, eager and with each `--compile` mode (`miles.models.compile`),
under `torch.profiler`, and prints its milliseconds split by what the kernels do: attention (the SDPA kernels),
matmuls and convolutions (the same ATen kernels compiled or not: inductor calls them), the optimizer, and the rest
(element-wise ops, norms, modulations, copies, Python and dispatch overhead: what compiling fuses).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ray  # noqa: E402
import torch  # noqa: E402

from miles.backends.fsdp_utils.loss_hub.sft import prepare_sft_batch  # noqa: E402
from miles.backends.fsdp_utils.loss_hub.types import DiffusionLossContext  # noqa: E402
from miles.backends.fsdp_utils.optim import build_optimizer  # noqa: E402
from miles.diffusion.schedule import flow_matching_loss  # noqa: E402
from miles.models.base import get_train_pipeline_config  # noqa: E402
from miles.utils.arguments import parse_args  # noqa: E402
from miles.utils.box import put_box  # noqa: E402
from miles.utils.types import shard_pairs  # noqa: E402


def make_pairs(family, n: int) -> dict[str, torch.Tensor]:
    family.load_text_encoders()
    embeds = family.encode_prompts([f"{i % 3 + 1} red circles on the left" for i in range(n)])
    g = torch.Generator().manual_seed(0)
    pairs = {"x0": torch.randn((n, *family.latent_shape()), generator=g), **embeds.to(dtype=torch.float32).to_columns()}
    return shard_pairs(pairs, 1)[0]  # one rank's pairs with their pair_index, as the trainer receives them


def cpu_loss_context(args, family) -> DiffusionLossContext:
    """The loss context of one fp32 CPU rank, as the trunk's rank 0 at dp 1 builds it."""
    return DiffusionLossContext(
        args=args,
        role="actor",
        rollout_id=0,
        dp_rank=0,
        dp_size=1,
        device=torch.device("cpu"),
        forward_dtype=torch.float32,
        family=family,
        networks={},
    )


def plain_loop(args, family, pairs, windows: int) -> float:
    """Seconds for `windows` optimizer steps of the same maths, no Ray, no FSDP, no hooks."""
    model = family.load_transformer()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    ctx = cpu_loss_context(args, family)
    n, mb = pairs["x0"].shape[0], args.micro_batch_size
    started = time.perf_counter()
    mb_id = 0
    for _ in range(windows):
        opt.zero_grad(set_to_none=True)
        for start in range(0, n, mb):
            batch = {k: v[start : start + mb] for k, v in pairs.items()}
            prepared = prepare_sft_batch(ctx, batch, microbatch_id=mb_id, optim_step_idx=0)
            mb_id += 1
            v = family.predict_velocity(model, prepared.latents, prepared.sigmas, prepared.embeds)
            loss = flow_matching_loss(v, prepared.extras["x0"], prepared.extras["noise"], prepared.sigmas).sum()
            (loss / n).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
        opt.step()
    return time.perf_counter() - started


# profiler event -> the part of a step it belongs to (first match of the name; self time), the rest is "other"
PARTS = (
    ("attention", ("scaled_dot_product", "flash_attention", "_efficient_attention")),
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "mkldnn_linear", "aten::_addmm_activation")),
    ("convolution", ("convolution", "mkldnn_convolution", "aten::_slow_conv2d")),
)
OPTIMIZER_EVENT = "Optimizer.step#AdamW.step"


def profile_step(args, family, pairs: dict[str, torch.Tensor], modes: list[str], steps: int) -> None:
    """Print one micro-batch training step's milliseconds per part (PARTS, the optimizer, the rest), per mode."""
    from torch.profiler import ProfilerActivity, profile

    from miles.models.compile import compile_transformer

    mb = args.micro_batch_size
    batch = {k: v[:mb] for k, v in pairs.items()}
    ctx = cpu_loss_context(args, family)
    prepared = prepare_sft_batch(ctx, batch, microbatch_id=0, optim_step_idx=0)
    columns = ("attention", "matmul", "convolution", "optimizer", "other")
    print(f"one training step of {mb} pairs, {torch.get_num_threads()} thread(s), median of {steps} (profiled: ms)")
    print(f"{'mode':<8}{'step ms':>9}" + "".join(f"{c:>13}" for c in columns) + f"{'compile s':>11}")
    for mode in modes:
        model = family.load_transformer()
        model.train()
        started = time.perf_counter()
        compile_transformer(model, family.transformer_blocks(model), mode)
        optimizer = build_optimizer(model.parameters(), args, args.lr)

        def step(model=model, optimizer=optimizer) -> None:
            optimizer.zero_grad(set_to_none=True)
            v = family.predict_velocity(model, prepared.latents, prepared.sigmas, prepared.embeds)
            loss = flow_matching_loss(v, prepared.extras["x0"], prepared.extras["noise"], prepared.sigmas).sum()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
            optimizer.step()

        step()  # the compile, for the compiled modes
        compile_s = time.perf_counter() - started
        for _ in range(3):
            step()
        seconds = []
        for _ in range(steps):
            t = time.perf_counter()
            step()
            seconds.append(time.perf_counter() - t)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                step()
        ms = dict.fromkeys(columns, 0.0)
        total = 0.0
        for event in prof.key_averages():
            self_ms = event.self_cpu_time_total / 1e3 / steps
            total += self_ms
            if event.key == OPTIMIZER_EVENT:  # its kernels ran inside it and were counted in "other" below
                ms["optimizer"] = event.cpu_time_total / 1e3 / steps
                ms["other"] -= ms["optimizer"] - self_ms
                continue
            part = next((name for name, keys in PARTS if any(k in event.key for k in keys)), "other")
            ms[part] += self_ms
        median_ms = statistics.median(seconds) * 1e3
        cells = "".join(f"{ms[c]:>7.2f} ({ms[c] / total:>3.0%})" for c in columns)
        print(f"{mode:<8}{median_ms:>9.2f}{cells}{compile_s if mode != 'off' else 0.0:>11.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf-checkpoint", default=None)
    parser.add_argument("--pairs", type=int, default=32, help="pairs per optimizer step")
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--windows", type=int, default=16, help="optimizer steps per measured call")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument(
        "--compile", default="blocks", choices=("off", "blocks", "full"), help="the compiled side's mode (off: none)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads on both sides (1 keeps Ray's own processes from stealing a core mid-measurement)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="no Ray: where one micro-batch's training step spends its time, eager and compiled (see above)",
    )
    opts = parser.parse_args()
    tmp = tempfile.mkdtemp(prefix="miles-bench-")
    path = opts.hf_checkpoint
    if path is None:
        from miles.models.sd3.tiny import save_tiny_sd3_pipeline

        path = save_tiny_sd3_pipeline(os.path.join(tmp, "tiny"), seed=0)
    total = opts.pairs * opts.windows
    args = trunk_args(path, opts, total, "off")
    torch.set_num_threads(max(1, round(args.cpus_per_rank)))
    family = get_train_pipeline_config(path)
    pairs = make_pairs(family, total)
    if opts.profile:
        profile_step(args, family, pairs, ["off", "blocks", "full"], steps=max(opts.windows, 10))
        return
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, _temp_dir=os.path.join(tmp, "ray"), log_to_driver=False)
    from miles.ray.train_group import RayTrainGroup

    sides = {"miles trunk (Ray + FSDP2)": RayTrainGroup(args, "actor", timeout=600)}
    if opts.compile != "off":
        sides[f"miles trunk, --compile {opts.compile}"] = RayTrainGroup(
            trunk_args(path, opts, total, opts.compile), "actor", timeout=1800
        )
    times: dict[str, list[float]] = {"plain PyTorch loop": [], **{name: [] for name in sides}}
    warm_up_s = {}
    try:
        for name, group in sides.items():
            group.init()
            started = time.perf_counter()
            group.train(0, [put_box(pairs)])  # warm-up (and the compiled side's compile)
            warm_up_s[name] = time.perf_counter() - started
        plain_loop(args, family, {k: v[: opts.pairs] for k, v in pairs.items()}, 1)  # warm-up
        for rep in range(opts.repeats):
            for name, group in sides.items():
                boxed = [put_box(pairs)]  # the rollout side's put, not the trunk's work
                started = time.perf_counter()
                group.train(rep + 1, boxed)
                times[name].append(time.perf_counter() - started)
            plain = plain_loop(args, family, {k: v[: opts.pairs] for k, v in pairs.items()}, opts.windows)
            times["plain PyTorch loop"].append(plain)
    finally:
        for group in sides.values():
            group.shutdown()
        ray.shutdown()
    print(f"{'runner':<34}{'pairs/s best':>14}{'pairs/s median':>16}{'first call s':>14}")
    for name, seconds in times.items():
        first = f"{warm_up_s[name]:>14.1f}" if name in warm_up_s else ""
        print(f"{name:<34}{total / min(seconds):>14.1f}{total / statistics.median(seconds):>16.1f}{first}")
    names = list(times)
    print_ratio("trunk / plain", times[names[1]], times[names[0]], opts.repeats, "≥ 0.9")
    if len(names) > 2:
        print_ratio(
            f"--compile {opts.compile} trunk / eager trunk", times[names[2]], times[names[1]], opts.repeats, "≥ 1.2"
        )
        print_ratio(f"--compile {opts.compile} trunk / plain", times[names[2]], times[names[0]], opts.repeats, "")


def print_ratio(what: str, fast: list[float], slow: list[float], repeats: int, target: str) -> None:
    """Throughput ratio of the side timed `fast` over the side timed `slow` (seconds per call)."""
    best, median = min(slow) / min(fast), statistics.median(slow) / statistics.median(fast)
    print(
        f"ratio {what} = {best:.3f} best-of-{repeats}, {median:.3f} median" + (f"  (target {target})" if target else "")
    )


def trunk_args(path: str, opts: argparse.Namespace, total: int, compile_mode: str) -> argparse.Namespace:
    return parse_args(
        [
            "--loss-type",
            "sft_loss",
            "--train-only",
            "--hf-checkpoint",
            path,
            "--prompt-data",
            "builtin:shapes",
            "--dp-size",
            "1",
            "--rollout-batch-size",
            str(total),
            "--global-batch-size",
            str(opts.pairs),
            "--num-steps-per-rollout",
            str(opts.windows),
            "--micro-batch-size",
            str(opts.micro_batch_size),
            "--num-rollout",
            str(opts.repeats + 1),
            "--cpus-per-rank",
            str(opts.threads),
            "--log-level",
            "WARNING",
            "--compile",
            compile_mode,
        ]
    )


if __name__ == "__main__":
    main()
