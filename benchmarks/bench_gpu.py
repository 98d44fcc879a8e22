"""One real-size training step on a GPU: SD3.5-Medium, SD3.5-Large and FLUX.1-dev transformers (1024 px) and the
Wan 2.1 1.3B / 14B video transformers (81 frames at 480x832), random weights from their published configs, in bf16:
step time, peak GPU memory and model FLOPs utilization (MFU).

    python benchmarks/bench_gpu.py                                   # every preset, 1024 px, batch 1, on cuda:0
    python benchmarks/bench_gpu.py --preset flux-dev --gradient-checkpointing --master-dtype bf16
    python benchmarks/bench_gpu.py --rl-pipeline /path/to/stable-diffusion-3.5-medium   # + a whole RL iteration

How it measures, per preset (configurations side by side in one run; nothing here is a timed test):
- FLOPs of one training step (forward + backward) are counted by `torch.utils.flop_counter` on the meta device (no
  memory, any machine): matmuls and attention as the model runs them, so the per-sample adaLN modulation is not
  counted per token (6·N·T would overstate FLOPs by ~45% for FLUX).
- The step: the transformer built on the meta device, sharded with miles' own `apply_fsdp2` (world size 1, the
  forward in bf16, the optimizer on `--master-dtype` weights), materialised on the GPU, AdamW; `--warmup` untimed
  steps then the median of `--steps` timed steps (CUDA-synchronised). Peak memory: `torch.cuda.max_memory_allocated`.
  A configuration that does not fit is reported as OOM, not a crash (FLUX.1-dev's 12B with fp32 master weights and
  AdamW needs ~190 GB before activations: use `--master-dtype bf16` or several GPUs).
- MFU = counted FLOPs x batch / step time / the GPU's dense bf16 peak (a table of known GPUs, or `--peak-tflops`).
- `--preset wan2.1-14b-sp8` (not in the default set: it needs 8 GPUs): Wan 2.1 14B at 81 frames x 720x1280 (75,600
  tokens a sample) with Ulysses sequence parallelism over 8 ranks, one process per GPU (`torch.multiprocessing`,
  NCCL), FSDP2 over the 8 as well: what `--sp-size 8 --dp-size 1` trains. Step time is the slowest rank's, peak memory
  the largest rank's, MFU per GPU. Add `--gradient-checkpointing` (the fp32 master weights and AdamW alone are ~29 GB a
  rank). `--preset tiny-wan-sp2 --device cpu` runs the same path on two CPU ranks (the test suite does).
- `--rl-pipeline`: a whole RL iteration at real size, `train_diffusion.py` with Flow-GRPO for `--rl-rollouts`
  rollouts on that local pipeline folder; prints the per-rollout phase times from its metrics.jsonl.

Without CUDA it prints the FLOP counts only (`--device cpu` with `--preset tiny` runs the whole path on a toy model,
which the test suite does). GPU numbers go in docs/user-guide/memory.md with the date and GPU once measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from miles.backends.fsdp_utils.fsdp import apply_fsdp2  # noqa: E402
from miles.backends.fsdp_utils.lora import apply_lora  # noqa: E402
from miles.models.sequence_parallel import SequenceParallelGroup, new_sequence_parallel_group  # noqa: E402
from miles.models.wan.sequence_parallel import shard_wan_sequence  # noqa: E402
from miles.utils.distributed import destroy_process_group, find_free_port, init_process_group  # noqa: E402

GIB = 2**30
# --lora-rank: the attention projections every preset's blocks share (diffusers' Attention naming), as miles' LoRA
LORA = {"target_modules": ["to_q", "to_k", "to_v", "to_out.0"], "init_lora_weights": True}

# dense bf16 tensor-core peaks (TFLOP/s) by a substring of torch.cuda.get_device_name(); no sparsity
PEAK_BF16_TFLOPS = {
    "H200": 989.4,
    "H100 SXM": 989.4,
    "H100 80GB HBM3": 989.4,
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H100": 989.4,
    "GH200": 989.4,
    "B200": 2250.0,
    "A100": 312.0,
    "L40S": 362.1,
    "A10G": 70.0,
    "L4": 121.0,
}


@dataclass(frozen=True)
class Preset:
    """A transformer class, its published config, the text tokens its pipeline feeds, and its inputs."""

    name: str
    class_name: str
    config: dict[str, Any]
    text_tokens: int  # the pipeline's default prompt length (SD3: 77 CLIP + 256 T5; FLUX, Wan: 512 T5)
    # (config, batch, resolution or video size, text tokens, dtype) -> the transformer's forward kwargs
    make_inputs: Callable[[dict[str, Any], int, Any, int, torch.dtype], dict[str, torch.Tensor]]
    video: tuple[int, int, int] | None = None  # (frames, height, width) of a video preset; images: --resolution
    # Ulysses sequence parallelism (Wan only): the step runs on sp_size ranks (one GPU each) that split one sample's
    # tokens between its first block and the output norm (miles.models.wan.sequence_parallel) and shard the
    # parameters with FSDP2 over all of them: what --sp-size does in the trainer, at dp 1
    sp_size: int = 1

    def size(self, resolution: int) -> Any:
        return self.video if self.video is not None else resolution

    def describe(self, resolution: int) -> str:
        size = "{}x{}x{}".format(*self.video) if self.video is not None else f"{resolution} px"
        return size if self.sp_size == 1 else f"{size} sp{self.sp_size}"

    def build(self) -> torch.nn.Module:
        import diffusers

        return getattr(diffusers, self.class_name)(**self.config)

    def blocks(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """The blocks FSDP shards one by one (Wan names them `blocks`)."""
        if hasattr(model, "blocks"):
            return list(model.blocks)
        return [*model.transformer_blocks, *getattr(model, "single_transformer_blocks", [])]


def _sd3_inputs(config, batch, resolution, text_tokens, dtype):
    side = latent_side(resolution)
    return dict(
        hidden_states=torch.randn(batch, config["in_channels"], side, side, dtype=dtype),
        encoder_hidden_states=torch.randn(batch, text_tokens, config["joint_attention_dim"], dtype=dtype),
        pooled_projections=torch.randn(batch, config["pooled_projection_dim"], dtype=dtype),
        timestep=torch.full((batch,), 500.0),  # fp32, as the families pass it
    )


def _flux_inputs(config, batch, resolution, text_tokens, dtype):
    packed = (latent_side(resolution) // 2) ** 2  # 2x2 patches of 16-channel latents: in_channels 64
    return dict(
        hidden_states=torch.randn(batch, packed, config["in_channels"], dtype=dtype),
        encoder_hidden_states=torch.randn(batch, text_tokens, config["joint_attention_dim"], dtype=dtype),
        pooled_projections=torch.randn(batch, config["pooled_projection_dim"], dtype=dtype),
        timestep=torch.full((batch,), 0.5),
        guidance=torch.full((batch,), 3.5) if config.get("guidance_embeds") else None,
        img_ids=torch.zeros(packed, 3),
        txt_ids=torch.zeros(text_tokens, 3),
    )


def _wan_inputs(config, batch, video, text_tokens, dtype):
    frames, height, width = video  # the VAE: 4x in time (plus the first frame), 8x in space
    if (frames - 1) % 4 or height % 16 or width % 16:
        raise ValueError(f"Wan video size {video}: frames must be 4k + 1, height and width multiples of 16")
    latent = (batch, config["in_channels"], (frames - 1) // 4 + 1, height // 8, width // 8)
    return dict(
        hidden_states=torch.randn(*latent, dtype=dtype),
        encoder_hidden_states=torch.randn(batch, text_tokens, config["text_dim"], dtype=dtype),
        timestep=torch.full((batch,), 500.0),  # fp32, as the families pass it
    )


SD35_MEDIUM = dict(  # stabilityai/stable-diffusion-3.5-medium transformer/config.json (2.5B)
    sample_size=128,
    patch_size=2,
    in_channels=16,
    out_channels=16,
    num_layers=24,
    attention_head_dim=64,
    num_attention_heads=24,
    joint_attention_dim=4096,
    caption_projection_dim=1536,
    pooled_projection_dim=2048,
    pos_embed_max_size=384,
    qk_norm="rms_norm",
    dual_attention_layers=tuple(range(13)),
)
SD35_LARGE = dict(  # stabilityai/stable-diffusion-3.5-large transformer/config.json (8.1B)
    sample_size=128,
    patch_size=2,
    in_channels=16,
    out_channels=16,
    num_layers=38,
    attention_head_dim=64,
    num_attention_heads=38,
    joint_attention_dim=4096,
    caption_projection_dim=2432,
    pooled_projection_dim=2048,
    pos_embed_max_size=192,
    qk_norm="rms_norm",
)
FLUX_DEV = dict(  # black-forest-labs/FLUX.1-dev transformer/config.json (11.9B)
    patch_size=1,
    in_channels=64,
    num_layers=19,
    num_single_layers=38,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=4096,
    pooled_projection_dim=768,
    guidance_embeds=True,
    axes_dims_rope=(16, 56, 56),
)
WAN21_14B = dict(  # Wan-AI/Wan2.1-T2V-14B-Diffusers transformer/config.json (14.3B; Wan 2.2 A14B: two of these)
    patch_size=(1, 2, 2),
    num_attention_heads=40,
    attention_head_dim=128,
    in_channels=16,
    out_channels=16,
    text_dim=4096,
    freq_dim=256,
    ffn_dim=13824,
    num_layers=40,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    rope_max_seq_len=1024,
)
WAN21_1_3B = {**WAN21_14B, "num_attention_heads": 12, "ffn_dim": 8960, "num_layers": 30}  # 1.4B
TINY = dict(  # a toy SD3 transformer: the whole path on a CPU in a second (the test suite runs it)
    sample_size=8,
    patch_size=2,
    in_channels=4,
    out_channels=4,
    num_layers=2,
    attention_head_dim=8,
    num_attention_heads=2,
    joint_attention_dim=16,
    caption_projection_dim=16,
    pooled_projection_dim=16,
    pos_embed_max_size=16,
)

TINY_WAN = dict(  # a toy Wan transformer: the sequence-parallel path on CPU ranks (the test suite runs it)
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=8,
    in_channels=4,
    out_channels=4,
    text_dim=16,
    freq_dim=16,
    ffn_dim=32,
    num_layers=2,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    rope_max_seq_len=64,
)

PRESETS = {
    "sd3.5-medium": Preset("sd3.5-medium", "SD3Transformer2DModel", SD35_MEDIUM, 77 + 256, _sd3_inputs),
    "sd3.5-large": Preset("sd3.5-large", "SD3Transformer2DModel", SD35_LARGE, 77 + 256, _sd3_inputs),
    "flux-dev": Preset("flux-dev", "FluxTransformer2DModel", FLUX_DEV, 512, _flux_inputs),
    "wan2.1-1.3b": Preset("wan2.1-1.3b", "WanTransformer3DModel", WAN21_1_3B, 512, _wan_inputs, (81, 480, 832)),
    "wan2.1-14b": Preset("wan2.1-14b", "WanTransformer3DModel", WAN21_14B, 512, _wan_inputs, (81, 480, 832)),
    # 720p, 81 frames: 21 x 45 x 80 = 75,600 tokens a sample, split over 8 GPUs (40 heads: 5 a rank in attention)
    "wan2.1-14b-sp8": Preset(
        "wan2.1-14b-sp8", "WanTransformer3DModel", WAN21_14B, 512, _wan_inputs, (81, 720, 1280), sp_size=8
    ),
    "tiny": Preset("tiny", "SD3Transformer2DModel", TINY, 8, _sd3_inputs),
    "tiny-wan-sp2": Preset("tiny-wan-sp2", "WanTransformer3DModel", TINY_WAN, 8, _wan_inputs, (5, 32, 32), sp_size=2),
}
REAL_PRESETS = ("sd3.5-medium", "sd3.5-large", "flux-dev", "wan2.1-1.3b", "wan2.1-14b")


def latent_side(resolution: int) -> int:
    if resolution % 16:
        raise ValueError(f"--resolution must be a multiple of 16 (VAE factor 8 x patch 2), got {resolution}")
    return resolution // 8


def _loss(output: Any) -> torch.Tensor:
    return output[0].float().pow(2).mean()


def count_step_flops(preset: Preset, resolution: int, frozen: bool = False) -> tuple[int, int]:
    """(parameters, FLOPs of one forward + backward of one sample) on the meta device. `frozen`: the weights take no
    gradient, only the activations do (LoRA's step, less its rank-r adapters' few FLOPs)."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        model = preset.build().to(torch.bfloat16).requires_grad_(not frozen)
        params = sum(p.numel() for p in model.parameters())
        inputs = preset.make_inputs(preset.config, 1, preset.size(resolution), preset.text_tokens, torch.bfloat16)
        if frozen:
            inputs["hidden_states"].requires_grad_(True)
        with FlopCounterMode(display=False) as counter:
            _loss(model(**inputs, return_dict=False)).backward()
    return params, counter.get_total_flops()


def peak_tflops(device: torch.device, override: float | None) -> float | None:
    if override:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_BF16_TFLOPS.items():
        if key in name:
            return value
    return None


def measure_step(
    preset: Preset, opts: argparse.Namespace, device: torch.device, sp: SequenceParallelGroup | None = None
) -> dict[str, Any]:
    """Median step time and peak memory of FSDP2 training steps over the default process group (world size 1, or
    the `sp` group's ranks with the tokens split over them); {"oom": True} when it does not fit."""
    from miles.backends.fsdp_utils.fsdp import parse_dtype

    cuda = device.type == "cuda"
    compute = torch.bfloat16
    master = parse_dtype(opts.master_dtype)
    model = optimizer = None
    try:
        with torch.device("meta"):  # the sharded parameters the optimizer updates (with LoRA a frozen bf16 base)
            model = preset.build().to(compute if opts.lora_rank else master)
        if opts.lora_rank:
            apply_lora(model, {**LORA, "r": opts.lora_rank, "lora_alpha": float(opts.lora_rank)})
        model.train()
        if sp is not None:
            shard_wan_sequence(model, sp)
        apply_fsdp2(
            model,
            preset.blocks(model),
            param_dtype=compute,
            reduce_dtype=torch.float32,
            # as the trainer: the inputs come cast (latents and text in bf16, timesteps fp32); with FSDP2 casting the
            # root's inputs, a root split into groups of two dtypes (Wan's fp32 time embedder, scale-shift table)
            # would hand its bf16 patch embedding fp32 latents
            cast_root_inputs=False,
            gradient_checkpointing=opts.gradient_checkpointing,
        )
        model.to_empty(device=device)
        with torch.no_grad():
            for param in model.parameters():
                param.normal_(0.0, 0.02)
        trained = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trained, lr=1e-5, foreach=cuda)
        inputs = preset.make_inputs(
            preset.config, opts.batch, preset.size(opts.resolution), preset.text_tokens, compute
        )
        inputs = {k: None if v is None else v.to(device) for k, v in inputs.items()}
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        times = []
        for i in range(opts.warmup + opts.steps):
            if cuda:
                torch.cuda.synchronize(device)
            started = time.perf_counter()
            _loss(model(**inputs, return_dict=False)).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize(device)
            if i >= opts.warmup:
                times.append(time.perf_counter() - started)
        peak = torch.cuda.max_memory_allocated(device) if cuda else None
        trained_params = sum(p.numel() for p in trained)
        return {"oom": False, "step_s": statistics.median(times), "peak_bytes": peak, "trained_params": trained_params}
    except torch.OutOfMemoryError:
        return {"oom": True}
    finally:
        del model, optimizer
        if cuda:
            torch.cuda.empty_cache()


def _sp_rank_main(rank: int, name: str, opts: dict[str, Any], device_type: str, port: int, out: str) -> None:
    """One rank of a sequence-parallel preset (`mp.spawn`): GPU `rank` (or a CPU process with gloo), the group of all
    ranks, the same sample on each (one seed), `measure_step`; its report written to out/rank{rank}.json."""
    preset = PRESETS[name]
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // preset.sp_size))
    # a rank that runs out of memory leaves the others waiting in a collective: the timeout ends them
    init_process_group(rank, preset.sp_size, "127.0.0.1", port, device, timeout=timedelta(minutes=5))
    try:
        torch.manual_seed(0)  # one sample for the whole group, as an sp group trains one dp shard
        row = measure_step(preset, argparse.Namespace(**opts), device, new_sequence_parallel_group(preset.sp_size))
    finally:
        destroy_process_group()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(row, f)


def measure_sp_step(preset: Preset, opts: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """`measure_step` on `preset.sp_size` ranks, one process and GPU each: the slowest rank's median step time and the
    largest per-rank peak memory; {"skipped": why} when there are fewer GPUs than ranks."""
    if device.type == "cuda" and torch.cuda.device_count() < preset.sp_size:
        return {"skipped": f"needs {preset.sp_size} GPUs, {torch.cuda.device_count()} visible"}
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:  # the spawned ranks import this file by its module name
        sys.path.insert(0, here)
    with tempfile.TemporaryDirectory() as out:
        args = (preset.name, vars(opts), device.type, find_free_port(), out)
        mp.spawn(_sp_rank_main, args=args, nprocs=preset.sp_size)
        rows = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(preset.sp_size)]
    if any(row["oom"] for row in rows):
        return {"oom": True}
    peaks = [row["peak_bytes"] for row in rows]
    return {
        "oom": False,
        "step_s": max(row["step_s"] for row in rows),
        "peak_bytes": None if None in peaks else max(peaks),
    }


def rl_iteration(pipeline: str, rollouts: int, extra: list[str]) -> dict[str, float]:
    """Median per-rollout phase times of a Flow-GRPO run of `rollouts` rollouts on a local pipeline folder."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as out:
        command = [
            sys.executable,
            os.path.join(root, "train_diffusion.py"),
            "--hf-checkpoint",
            pipeline,
            "--loss-type",
            "policy_loss",
            "--num-rollout",
            str(rollouts),
            "--eval-interval",
            "0",
            "--output-dir",
            out,
            "--no-progress",
            *extra,
        ]
        print("running:", " ".join(command), flush=True)
        subprocess.run(command, check=True)
        records = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")) if line.strip()]
    series: dict[str, list[float]] = {}
    for record in records:
        for key, value in record.items():
            if key.startswith("perf/") and isinstance(value, (int, float)):
                series.setdefault(key, []).append(float(value))
    return {key: statistics.median(values) for key, values in sorted(series.items())}


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", action="append", choices=sorted(PRESETS), help="Repeatable; default: all real.")
    parser.add_argument("--resolution", type=int, default=1024, help="Image side in pixels.")
    parser.add_argument("--batch", type=int, default=1, help="Images per step.")
    parser.add_argument("--master-dtype", default="fp32", choices=["fp32", "bf16"], help="Optimizer weights' dtype.")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="Checkpoint every transformer block.")
    parser.add_argument(
        "--lora-rank", type=int, default=0, help="Train a rank-R LoRA on a frozen bf16 base (0: full fine-tuning)."
    )
    parser.add_argument("--warmup", type=int, default=2, help="Untimed steps first.")
    parser.add_argument("--steps", type=int, default=5, help="Timed steps (the median is reported).")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (only sensible with --preset tiny).")
    parser.add_argument(
        "--peak-tflops", type=float, default=None, help="The GPU's dense bf16 peak, if not in the table."
    )
    parser.add_argument("--rl-pipeline", default=None, help="A local pipeline folder: also time a whole RL iteration.")
    parser.add_argument("--rl-rollouts", type=int, default=3, help="Rollouts of the RL iteration run.")
    parser.add_argument("--rl-args", default="", help="Extra train_diffusion.py arguments for the RL run (one string).")
    opts = parser.parse_args(argv)
    import diffusers

    diffusers.utils.logging.set_verbosity_error()  # the bf16 cast warning of from-config models, once per model
    names = opts.preset or list(REAL_PRESETS)
    device = torch.device(opts.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: FLOP counts only; step time, memory and MFU are not measured")
        device = None
    peak = peak_tflops(device, opts.peak_tflops) if device is not None else None
    results: dict[str, dict[str, Any]] = {}
    if device is not None:
        init_process_group(0, 1, "127.0.0.1", find_free_port(), device, timeout=None)
    try:
        for name in names:
            preset = PRESETS[name]
            params, flops = count_step_flops(preset, opts.resolution, frozen=opts.lora_rank > 0)
            row: dict[str, Any] = {"params": params, "step_tflop_per_sample": flops / 1e12}
            if device is not None:
                row.update(
                    measure_step(preset, opts, device) if preset.sp_size == 1 else measure_sp_step(preset, opts, device)
                )
                if row.get("oom") is False and peak:  # per GPU: an sp preset's step runs on sp_size of them
                    row["mfu"] = flops * opts.batch / row["step_s"] / (peak * 1e12 * preset.sp_size)
            results[name] = row
    finally:
        if device is not None:
            destroy_process_group()

    where = "none" if device is None else torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"images {opts.resolution} px, batch {opts.batch}, bf16 forward, "
        f"{f'LoRA rank {opts.lora_rank} on a bf16 base' if opts.lora_rank else f'{opts.master_dtype} master weights'}, "
        f"checkpointing {'on' if opts.gradient_checkpointing else 'off'}, device {where}, "
        f"bf16 peak {f'{peak:.0f} TFLOP/s' if peak else 'unknown (--peak-tflops)'}"
    )
    print(f"{'preset':<16}{'size':>18}{'params':>9}{'TFLOP/step':>12}{'step s':>9}{'peak GiB':>10}{'MFU':>7}")
    for name, r in results.items():
        measured = f"  {r['skipped']}" if "skipped" in r else ""
        if "oom" in r:
            measured = f"{'OOM':>9}" if r["oom"] else f"{r['step_s']:>9.3f}"
            if not r["oom"]:
                measured += f"{r['peak_bytes'] / GIB:>10.1f}" if r["peak_bytes"] is not None else f"{'-':>10}"
                measured += f"{r['mfu']:>7.1%}" if "mfu" in r else f"{'-':>7}"
        tflop = r["step_tflop_per_sample"] * opts.batch
        size = PRESETS[name].describe(opts.resolution)
        print(f"{name:<16}{size:>18}{r['params'] / 1e9:>8.2f}B{tflop:>12.1f}{measured}")
    if opts.rl_pipeline:
        times = rl_iteration(opts.rl_pipeline, opts.rl_rollouts, opts.rl_args.split())
        results["rl_iteration"] = times
        print("RL iteration (median per rollout): " + ", ".join(f"{k} {v:.2f}" for k, v in times.items()))
    return results


if __name__ == "__main__":
    main()
