"""One whole Flow-GRPO iteration of the real-size Wan 2.1 1.3B transformer on CPU through miles' driver, then a run
resumed from its checkpoint: peak resident memory per process, seconds per phase and the weight sync's bytes, as one
table.

    python benchmarks/bench_real_size.py                          # Wan 2.1 1.3B's transformer, LoRA, 5 frames at 64x64
    python benchmarks/bench_real_size.py --weights full --layers 16  # 16 of its 30 layers, every weight trained

The model is a diffusers `WanPipeline` folder with random weights in which only the transformer is real-size:
Wan2.1-T2V-1.3B's `WanTransformer3DModel` config (30 layers, 12 heads x 128, ffn 8960, text_dim 4096: 1.42B
parameters), stored in bf16. The text encoder and VAE are small: a one-layer UMT5 of the transformer's text width
(d_model 4096, d_ff 256, the tiny T5 vocabulary; prompts padded to Wan's 512 tokens, so the cross-attention sees
real-length text), and the tiny Wan pipeline's VAE layout (`miles.models.wan.tiny`) with 16 latent channels, the
transformer's in/out channels (the tiny VAE has 4); the scheduler is the tiny pipeline's flow-matching Euler one.

Two runs of `train_diffusion.run` at dp 2 on their own local Ray clusters, with `--loss-type policy_loss` and the
`temporal_consistency` frame reward:
1. rollout 0: generate with recording (SDE), score, train one window, save a checkpoint (`--save`), sync weights;
2. `--load` of that checkpoint, then rollout 1 (the same phases, no save).
Memory is each process's peak resident set (VmHWM in /proc/PID/status, shared pages such as Ray's object store
included), read just before the run shuts down: the driver (this process, peak reset before each run), each trainer
rank (its pid through Ray), the rollout engine, and Ray's own processes (the sum of their peaks); and the peak of
everything together, sampled every 0.5 s as the sum of the processes' PSS (shared pages counted once). Seconds are
the run's `perf/*` metrics; the checkpoint load is timed after run 2 on its live ranks (`_load` again, the path the
resumed run took). The weight sync's bytes are the exported state dict's (the master dtype's entries, or the LoRA
ones). The run stops with an error when the machine's available memory falls below --min-available-gib.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import psutil  # noqa: E402
import torch  # noqa: E402
from bench_memory import reset_peak, rss  # noqa: E402

from miles.arguments.parser import parse_args  # noqa: E402
from miles.backends.fsdp_utils.fsdp import parse_dtype  # noqa: E402
from miles.backends.fsdp_utils.lora import apply_lora, lora_config_from_args, lora_state_dict  # noqa: E402
from miles.models.wan.wan import WanPipelineConfig  # noqa: E402
from miles.utils.tracking import read_metrics  # noqa: E402

GIB = 2**30
WAN_TEXT_TOKENS = 512  # WanPipeline's max_sequence_length: prompts are padded to it
TEXT_ENCODER = dict(d_kv=32, d_ff=256, num_layers=1, num_heads=2)  # small: only d_model (4096) is Wan's
PRECISION = ["--fsdp-master-dtype", "bf16", "--diffusion-forward-dtype", "bf16", "--diffusion-recompute-old-log-prob"]


def wan_1_3b_config(layers: int = 30) -> dict:
    """Wan2.1-T2V-1.3B's transformer/config.json, with `layers` blocks (30 in the released model)."""
    return dict(
        patch_size=(1, 2, 2),
        num_attention_heads=12,
        attention_head_dim=128,
        in_channels=16,
        out_channels=16,
        text_dim=4096,
        freq_dim=256,
        ffn_dim=8960,
        num_layers=layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
        image_dim=None,
        added_kv_proj_dim=None,
        rope_max_seq_len=1024,
    )


def save_real_size_wan_pipeline(
    folder: str, transformer_config: dict, *, text_tokens: int = WAN_TEXT_TOKENS, seed: int = 0
) -> str:
    """A `WanPipeline` folder whose transformer has `transformer_config` (random weights, bf16) and whose text
    encoder, VAE, tokenizer and scheduler are small (module docstring); returns `folder`."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from miles.models.loading.pretrained import strip_name_or_path
    from miles.models.tiny import build_t5_tokenizer
    from miles.models.wan.tiny import SCHEDULER_SHIFT

    tokenizer = build_t5_tokenizer()
    tokenizer.model_max_length = text_tokens
    torch.manual_seed(seed)
    text_encoder = UMT5EncoderModel(
        UMT5Config(
            vocab_size=len(tokenizer),
            d_model=transformer_config["text_dim"],
            **TEXT_ENCODER,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=32,
            dropout_rate=0.0,
            feed_forward_proj="gated-gelu",
            is_encoder_decoder=False,
            use_cache=False,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    )
    channels = transformer_config["in_channels"]
    vae = AutoencoderKLWan(  # miles.models.wan.tiny's VAE layout, with the transformer's latent channels
        base_dim=8,
        z_dim=channels,
        dim_mult=[1, 2, 2, 2],
        num_res_blocks=1,
        attn_scales=[],
        temperal_downsample=[False, True, True],
        latents_mean=[0.0] * channels,
        latents_std=[1.0] * channels,
        scale_factor_temporal=4,
        scale_factor_spatial=8,
    )
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: half the memory and time of an fp32 build
    try:
        transformer = WanTransformer3DModel(**transformer_config)
    finally:
        torch.set_default_dtype(previous)
    pipe = WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=SCHEDULER_SHIFT),
        transformer=transformer,
        transformer_2=None,
        boundary_ratio=None,
    )
    for module in (text_encoder, vae, transformer):
        module.eval()
    Path(folder).mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(folder, safe_serialization=True)
    strip_name_or_path(folder)
    return folder


def synced_state(folder: str, args: argparse.Namespace) -> tuple[int, int, int]:
    """(tensors, parameters, bytes) of the state dict the trainer exports to the engines: the transformer's entries
    in the dtypes the trainer holds them in (`--fsdp-master-dtype`, fp32 for Wan's `_keep_in_fp32_modules`), or
    the LoRA entries only; from the network built on the meta device, as the trainer builds it."""
    family = WanPipelineConfig(folder)
    model = family.load_transformer(dtype=parse_dtype(args.fsdp_master_dtype), empty=True)
    if args.use_lora:
        apply_lora(model, lora_config_from_args(args, family.name))
    state = model.state_dict()
    if args.use_lora:
        state = lora_state_dict(state)
    return len(state), sum(t.numel() for t in state.values()), sum(t.numel() * t.element_size() for t in state.values())


def proc_status_bytes(pid: int, field: str) -> int:
    """A memory field of /proc/PID/status (VmHWM, VmRSS) in bytes; 0 when the process is gone."""
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def pss_bytes(pid: int) -> int:
    """The process's proportional set size (shared pages split among their users); 0 when it is gone."""
    with contextlib.suppress(OSError), open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


class MemoryWatch(threading.Thread):
    """Samples, every `interval` s, the summed PSS of this process and its descendants (Ray's processes and actors)
    and keeps the peak; stops the run (SIGINT to this process: the driver finishes the phase under way, then shuts
    its actors down; `miles.utils.stop_signals`) when the machine's available memory falls below `floor` bytes, since
    other users share the machine."""

    def __init__(self, floor: int, interval: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.floor, self.interval = floor, interval
        self.peak, self.tripped = 0, False
        self.done = threading.Event()

    def run(self) -> None:
        root = psutil.Process()
        while not self.done.wait(self.interval):
            with contextlib.suppress(psutil.Error):
                pids = [root.pid, *(p.pid for p in root.children(recursive=True))]
                self.peak = max(self.peak, sum(pss_bytes(pid) for pid in pids))
            if not self.tripped and psutil.virtual_memory().available < self.floor:
                self.tripped = True
                os.kill(os.getpid(), signal.SIGINT)

    def stop(self) -> int:
        self.done.set()
        self.join()
        return self.peak


def process_peaks(groups: dict) -> dict[str, int]:
    """Peak resident bytes (VmHWM) of the driver, each trainer rank, each engine and Ray's own processes (summed)."""
    import ray

    ranks = ray.get([actor.__ray_call__.remote(lambda _: os.getpid()) for actor in groups["actor"].actors])
    peaks = {"driver": rss("VmHWM")}
    peaks.update({f"trainer rank {rank}": proc_status_bytes(pid, "VmHWM") for rank, pid in enumerate(ranks)})
    engines, others = [], 0
    for proc in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if proc.pid in ranks:
                continue
            if (proc.cmdline() or [""])[0].startswith("ray::EngineActor"):
                engines.append(proc.pid)
            else:
                others += proc_status_bytes(proc.pid, "VmHWM")
    for index, pid in enumerate(sorted(engines)):
        peaks[f"rollout engine {index}" if len(engines) > 1 else "rollout engine"] = proc_status_bytes(pid, "VmHWM")
    peaks["Ray's own processes (sum of peaks)"] = others
    return peaks


def time_checkpoint_load(group) -> float:
    """Seconds the ranks take to load the run's --load checkpoint again (model, optimizer, RNG; `_load` on every
    rank at once, as at start-up)."""
    import ray

    def timed_load(actor) -> float:
        started = time.perf_counter()
        actor._load()
        return time.perf_counter() - started

    return max(ray.get([actor.__ray_call__.remote(timed_load) for actor in group.actors]))


def measure_run(argv: list[str], out: str, floor: int, time_load: bool) -> dict:
    """One `train_diffusion.run`: its rollout record, each process's peak, the sampled peak of them all, its wall
    seconds and (`time_load`) the checkpoint load re-timed on its live ranks."""
    import train_diffusion

    args = parse_args([*argv, "--output-dir", out])
    found: dict = {}

    def before_shutdown(groups: dict) -> None:
        found["peaks"] = process_peaks(groups)  # before the re-timed load, which would raise them
        if time_load:
            found["load_s"] = time_checkpoint_load(groups["actor"])

    watch = MemoryWatch(floor)
    reset_peak()
    watch.start()
    started = time.perf_counter()
    try:
        train_diffusion.run(args, before_shutdown=before_shutdown)
    finally:
        found["all_pss"] = watch.stop()
    if watch.tripped:
        raise SystemExit(f"stopped: available memory fell below {floor / GIB:.1f} GiB (--min-available-gib)")
    found["wall_s"] = time.perf_counter() - started
    records = [r for r in read_metrics(os.path.join(out, "metrics.jsonl")) if "perf/generate_total_s" in r]
    found["record"] = records[-1]
    return found


def directory_bytes(path: str) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def parse_options(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=30, help="Wan transformer blocks (30: Wan 2.1 1.3B).")
    parser.add_argument("--resolution", type=int, default=64, help="Frame side in pixels (a multiple of 16).")
    parser.add_argument("--num-frames", type=int, default=5, help="Frames per clip (4k + 1).")
    parser.add_argument("--steps", type=int, default=4, help="Denoising steps (--diffusion-num-steps).")
    parser.add_argument("--sde-steps", type=int, default=2, help="Trained steps (--diffusion-num-sde-steps).")
    parser.add_argument("--prompts", type=int, default=2, help="Prompts per rollout (--rollout-batch-size).")
    parser.add_argument("--samples-per-prompt", type=int, default=2, help="Samples per prompt (a GRPO group).")
    parser.add_argument("--text-tokens", type=int, default=WAN_TEXT_TOKENS, help="Tokens prompts are padded to.")
    parser.add_argument(
        "--weights",
        choices=("lora", "full"),
        default="lora",
        help="lora: train LoRA adapters on the frozen base (--use-lora; the default: full weights of all 30 layers do "
        "not fit 24 GiB at dp 2, docs/user-guide/memory.md); full: train every weight, bf16 masters.",
    )
    parser.add_argument("--pipeline", default=None, help="A folder built by an earlier run (skips the build).")
    parser.add_argument("--workdir", default=None, help="Keep the folder, checkpoint and outputs here.")
    parser.add_argument(
        "--min-available-gib", type=float, default=1.5, help="Stop when the machine's available memory falls below."
    )
    parser.add_argument("--extra", action="append", default=[], help="More miles flags, e.g. --extra=--lora-rank=4.")
    opts = parser.parse_args(argv)
    if opts.layers < 1:
        parser.error("--layers must be >= 1")
    if opts.resolution % 16:
        parser.error(f"--resolution {opts.resolution}: Wan needs a multiple of 16 (VAE factor 8 x patch 2)")
    if opts.num_frames < 1 or (opts.num_frames - 1) % 4:
        parser.error(f"--num-frames {opts.num_frames}: Wan needs 4k + 1 frames, e.g. 1 or 5")
    return opts


def run_flags(opts: argparse.Namespace, folder: str) -> list[str]:
    """The miles flags both runs share."""
    flags = [
        "--hf-checkpoint", folder,
        "--resolution", str(opts.resolution),
        "--num-frames", str(opts.num_frames),
        "--loss-type", "policy_loss",
        "--rm-type", "temporal_consistency",
        "--prompt-data", "builtin:shapes",
        "--dp-size", "2",
        "--rollout-batch-size", str(opts.prompts),
        "--n-samples-per-prompt", str(opts.samples_per_prompt),
        "--diffusion-num-steps", str(opts.steps),
        "--diffusion-num-sde-steps", str(opts.sde_steps),
        "--eval-interval", "0",
        "--image-grid-interval", "0",
        "--no-progress",
        "--log-level", "WARNING",
        *PRECISION,
    ]  # fmt: skip
    if opts.weights == "lora":
        flags.append("--use-lora")
    return [*flags, *(part for flag in opts.extra for part in flag.split("=", 1))]


def build_pipeline(folder: str, layers: int, text_tokens: int) -> float:
    """Build the folder in a child process (its ~3 GB of construction stays out of the driver's peak); seconds."""
    started = time.perf_counter()
    child = multiprocessing.get_context("spawn").Process(
        target=save_real_size_wan_pipeline,
        args=(folder, wan_1_3b_config(layers)),
        kwargs={"text_tokens": text_tokens},
    )
    child.start()
    child.join()
    if child.exitcode != 0:
        raise SystemExit(f"building the pipeline folder {folder} failed (exit code {child.exitcode})")
    return time.perf_counter() - started


def print_table(rows: list[tuple[str, str, str]]) -> None:
    print("| | run 1: rollout 0 + save | run 2: --load, rollout 1 |")
    print("|---|---|---|")
    for name, first, second in rows:
        print(f"| {name} | {first} | {second} |")


def main(argv: list[str] | None = None) -> None:
    opts = parse_options(argv)
    started = time.perf_counter()
    workdir = opts.workdir or tempfile.mkdtemp(prefix="bench_real_size_")
    try:
        folder = opts.pipeline or os.path.join(workdir, "pipeline")
        build_s = 0.0 if opts.pipeline else build_pipeline(folder, opts.layers, opts.text_tokens)
        flags, ckpt, floor = run_flags(opts, folder), os.path.join(workdir, "ckpt"), int(opts.min_available_gib * GIB)
        args = parse_args([*flags, "--num-rollout", "1"])
        tensors, params, sync_bytes = synced_state(folder, args)
        first = measure_run([*flags, "--num-rollout", "1", "--save", ckpt], os.path.join(workdir, "run1"), floor, False)
        ckpt_bytes = directory_bytes(ckpt)
        second = measure_run([*flags, "--num-rollout", "2", "--load", ckpt], os.path.join(workdir, "run2"), floor, True)
    finally:
        if opts.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    report(opts, args, first, second, (tensors, params, sync_bytes), ckpt_bytes)
    print(f"folder build {build_s:.0f} s; benchmark total {time.perf_counter() - started:.0f} s")


def report(opts, args, first: dict, second: dict, sync: tuple[int, int, int], ckpt_bytes: int) -> None:
    """The set-up in a line, then one table of both runs: peaks, seconds per phase, the weight sync's size."""
    tensors, params, sync_bytes = sync
    config = wan_1_3b_config(opts.layers)
    name = "Wan 2.1 1.3B" if opts.layers == 30 else f"Wan 2.1 1.3B's width, {opts.layers} of its 30 layers"
    tokens = ((opts.num_frames - 1) // 4 + 1) * (opts.resolution // 16) ** 2
    mode = f"LoRA rank {args.lora_rank} ({params / 1e6:.1f}M trained values)" if args.use_lora else "full weights"
    print(
        f"{name} transformer ({config['num_layers']} layers x {config['num_attention_heads']} heads x "
        f"{config['attention_head_dim']}), {mode}, bf16 masters and forwards, dp 2 on CPU; {opts.num_frames} frames "
        f"at {opts.resolution}x{opts.resolution} ({tokens} video + {opts.text_tokens} text tokens), {opts.steps} "
        f"steps ({opts.sde_steps} trained), {opts.prompts} x {opts.samples_per_prompt} samples, CFG "
        f"{args.diffusion_guidance_scale:g}"
    )
    rows = [(f"peak RSS GiB: {key}", f"{first['peaks'][key] / GIB:.2f}", f"{second['peaks'].get(key, 0) / GIB:.2f}")
            for key in first["peaks"]]  # fmt: skip
    rows.append(("peak of all processes together GiB (sampled PSS)", f"{first['all_pss'] / GIB:.2f}",
                 f"{second['all_pss'] / GIB:.2f}"))  # fmt: skip
    phases = [
        ("start-up: command to first rollout", "perf/startup_s"),
        ("generate (recorded SDE sampling)", "perf/rollout_s"),
        ("score (reward + advantages)", "perf/reward_s"),
        ("rollout total (generate + score + convert)", "perf/generate_total_s"),
        ("train one window", "perf/train_s"),
        ("save checkpoint", "perf/save_s"),
        ("weight sync", "perf/weight_sync_s"),
    ]
    for label, key in phases:
        values = [run["record"].get(key) for run in (first, second)]
        rows.append((f"s: {label}", *(f"{v:.1f}" if v is not None else "-" for v in values)))
    rows.append(("s: checkpoint load (re-timed on the live ranks)", "-", f"{second['load_s']:.1f}"))
    rows.append(("s: whole run (train_diffusion.run)", f"{first['wall_s']:.1f}", f"{second['wall_s']:.1f}"))
    sync_rate = [sync_bytes / run["record"]["perf/weight_sync_s"] / GIB for run in (first, second)]
    rows.append((f"weight sync: {tensors} tensors, {params / 1e6:.1f}M values, GiB (GiB/s)",
                 *(f"{sync_bytes / GIB:.3f} ({rate:.2f})" for rate in sync_rate)))  # fmt: skip
    rows.append(("checkpoint on disk GiB", f"{ckpt_bytes / GIB:.2f}", "-"))
    print_table(rows)


if __name__ == "__main__":
    main()
