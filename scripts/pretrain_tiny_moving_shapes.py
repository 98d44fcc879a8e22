"""Pretrain the tiny moving-shapes video model (`builtin:tiny-moving-shapes`), reproducibly, on CPU: a Wan
2.1-architecture pipeline (`WanPipeline`: UMT5 text encoder, AutoencoderKLWan, WanTransformer3DModel) that makes
5-frame 32x32 clips of the moving-shapes world ("a red circle moving to the left").

Stage 1 trains the VAE on the world's frames: an AutoencoderKLWan with one spatial downsample (2x) and no temporal
one, whose causal time convolutions see only the current frame (their earlier taps start at zero and, trained on
single frames, get no gradient), so a clip is encoded frame by frame into 5 latent frames of 16x16; the loss weighs
the shape's pixels 8x the canvas's; then its per-channel `latents_mean` / `latents_std` are measured. Stage 2 writes a pipeline folder with that VAE, a tiny random UMT5 whose
tokenizer knows the world's words, a fresh transformer, and runs miles' own SFT on it (`train_diffusion.run`,
`--loss-type sft_loss --train-only`, 2 FSDP ranks) on the world's train clips (`--prompt-data builtin:moving-shapes`).
Stage 3 samples held-out eval-split prompts with deterministic ODE steps (`evaluate_moving_shapes`, CFG-free) and
prints the accuracies; then the folder is copied to `--out`.

    python scripts/pretrain_tiny_moving_shapes.py --workdir /tmp/pretrain_moving --out miles/assets/tiny_moving_shapes

The defaults are the recipe of the shipped folder (miles/assets/tiny_moving_shapes, 5.1 MB: a 2-layer UMT5 of width
32, the VAE at base width 8 with 4 latent channels, a transformer of 4 blocks x 4 heads x 32 whose tokens are 5x2x2
latent patches, the whole clip's 5 frames of a 2x2 patch in one token (`--temporal-patch 5`, 64 tokens per clip),
1.23 M parameters; seed 0). Measured on the shared 2-core CPU machine (2026-12-04): VAE 600 steps in 278 s (load
average 5 to 19; its reconstructions of 200 eval clips: all-correct 1.0, PSNR 32.4 dB); SFT 1 200 steps in 927 s with
another job running (loss 1.19 over the first 100 steps, 0.149 over the last 50); eval 19 s. Held-out clips on 300
eval captions, 20 ODE steps, CFG-free: all-correct 0.860 (colour 0.997, shape 0.880, direction 0.970, reward 0.893).
Two measured pitfalls of the VAE stage: the decoder's output clamp passes no gradient and posterior samples at the
initial unit variance drown the encoder's means, so it trains on the unclamped decoder and the posterior mode; an
unweighted loss left the colours wrong after 400 steps (`--vae-ink-weight`); at 4x spatial compression (two
downsamples) 400 steps reconstructed 8% of clips all-correct.

Why a token holds the whole clip (measured 2026-12-04, each from the shipped VAE, seed 0, 1 200 SFT steps, the same
300-clip eval). The earlier recipe, one latent frame per token (`--temporal-patch 1 --patch 4 --head-dim 16`, the Wan
checkpoints' layout), learned colour (0.983) and sometimes shape (0.507) but not direction (0.157, below the 0.25 of a
random one; all-correct 0.073), and nothing changed that: 2 heads x 32 (direction 0.183), 1 head x 64 (0.150),
`--sft-logit-mean 1.1` (0.173), 2 400 more SFT steps (0.193, shape up to 0.793), 2x2 patches (`--patch 2`: 0.237, shape
0.857). The cause, measured on the sampler: from the same noise, swapping the caption's direction word changed the
clip by 0.7-1.1 of 255 per pixel (mean absolute difference) where swapping the colour changed it by 17 and another
noise by 18, though the text encoder's outputs for the direction words differ by 1.1-1.5 of their norm: the
transformer ignored the direction. Our reading: Wan's only positional signal is rotary, relative to each pair of tokens, so at high
noise (where a clip's layout is decided and the frames show nothing yet) no token can tell whether it sits in the
first frame or the last, and "to the left" is the time reversal of "to the right". A token of 5 latent frames sees
their order in its own channels: `--temporal-patch 5` at the old width reached direction 0.373 and a direction swap
changed the clip by 10.7 per pixel (shape 0.317: 80 output values per token at width 64), and at width 128 (head dim
32) the shipped 0.860. Real Wan checkpoints do not need this: their causal VAE encodes the first frame apart and real
motion has a time arrow the frames show.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "miles" / "assets" / "tiny_moving_shapes"
WORDS = ("moving", "up", "down")  # beyond the shapes world's words


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="Where the final pipeline folder is copied.")
    parser.add_argument("--workdir", default="outputs/pretrain_tiny_moving_shapes", help="Intermediate folders, logs.")
    parser.add_argument("--seed", type=int, default=0)
    # stage 1: VAE
    parser.add_argument("--vae-steps", type=int, default=600)
    parser.add_argument("--vae-batch-size", type=int, default=32, help="Frames per step.")
    parser.add_argument("--vae-lr", type=float, default=3e-3)
    parser.add_argument("--vae-kl-weight", type=float, default=1e-4, help="Per latent element, vs per-pixel L1+MSE.")
    parser.add_argument("--vae-base-dim", type=int, default=8)
    parser.add_argument("--vae-latent-channels", type=int, default=4)
    parser.add_argument("--vae-ink-weight", type=float, default=8.0, help="Loss weight of the shape's pixels.")
    parser.add_argument("--vae-downsamples", type=int, default=1, help="Spatial halvings (0: latents at full size).")
    parser.add_argument("--vae-clips", type=int, default=1024, help="Train clips whose frames the VAE learns.")
    # stage 2: transformer SFT
    parser.add_argument("--layers", type=int, default=4, help="WanTransformerBlocks.")
    parser.add_argument(
        "--patch", type=int, default=2, help="Latent pixels per token side: 8x8 tokens on the 16x16 latent frames."
    )
    parser.add_argument(
        "--temporal-patch",
        type=int,
        default=5,
        help="Latent frames per token (1 or 5): 5 puts a patch's whole clip in one token, which knows its frames' order.",
    )
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--text-length", type=int, default=16, help="UMT5 tokens per caption (captions are <= 8).")
    parser.add_argument("--sft-steps", type=int, default=1200, help="Optimizer steps.")
    parser.add_argument("--sft-batch-size", type=int, default=64, help="Global batch (2 ranks).")
    parser.add_argument("--sft-lr", type=float, default=2e-3)
    parser.add_argument("--sft-dataset-size", type=int, default=4096)
    parser.add_argument(
        "--sft-logit-mean",
        type=float,
        default=0.0,
        help="sft_loss's --sft-logit-mean: its noise levels' logit-normal mean (0: around sigma 0.5; ln 3 = 1.1: the "
        "sampler's shift 3).",
    )
    # stage 3: eval
    parser.add_argument("--eval-prompts", type=int, default=300)
    parser.add_argument("--eval-steps", type=int, default=20)
    parser.add_argument(
        "--media-out", default=str(ROOT / "docs" / "images"), help="Where the README's mp4 and contact sheet go."
    )
    parser.add_argument("--stages", default="vae,sft,eval", help="Run a subset (reusing --workdir outputs).")
    args = parser.parse_args(argv)
    from miles.data.moving_shapes import NUM_FRAMES  # the frame-wise VAE keeps every frame: as many latent frames

    if args.temporal_patch < 1 or NUM_FRAMES % args.temporal_patch:
        parser.error(f"--temporal-patch {args.temporal_patch} must divide the clip's {NUM_FRAMES} latent frames")
    return args


def log(message: str) -> None:
    print(f"[pretrain-moving {time.strftime('%H:%M:%S')}] {message}", flush=True)


def frames_tensor(items: list[dict]) -> torch.Tensor:
    """(N * F, 3, 1, H, W) float32 in [-1, 1]: every frame of the items' clips as a one-frame clip."""
    frames = np.concatenate([item["image"] for item in items]).astype(np.float32) / 127.5 - 1.0
    return torch.from_numpy(frames).permute(0, 3, 1, 2).unsqueeze(2).contiguous()


# ---- stage 1: the VAE -------------------------------------------------------------------------------------------------
def framewise_vae(args: argparse.Namespace):
    """Wan's VAE layout at toy width with 4x spatial and no temporal compression; every causal time convolution's
    taps on earlier frames zeroed, so each frame is encoded and decoded on its own."""
    from diffusers import AutoencoderKLWan
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

    torch.manual_seed(args.seed)
    channels = args.vae_latent_channels
    vae = AutoencoderKLWan(
        base_dim=args.vae_base_dim,
        z_dim=channels,
        dim_mult=[1] * (1 + args.vae_downsamples),
        num_res_blocks=1,
        attn_scales=[],
        temperal_downsample=[False] * args.vae_downsamples,
        latents_mean=[0.0] * channels,
        latents_std=[1.0] * channels,
        scale_factor_temporal=1,
        scale_factor_spatial=2**args.vae_downsamples,
    )
    with torch.no_grad():
        for module in vae.modules():
            if isinstance(module, WanCausalConv3d) and module.kernel_size[0] > 1:
                module.weight[:, :, :-1] = 0.0  # causal padding: the last tap is the current frame
    return vae


class _SingleFrameConvs:
    """While active, a causal time convolution given one frame without a cache runs as the 2D convolution of its
    current-frame taps: the same numbers as the 3D convolution over zero padding (whose earlier taps see only zeros),
    at a fraction of CPU time. Training feeds the VAE single frames."""

    def __enter__(self) -> None:
        from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

        self.cls, self.forward = WanCausalConv3d, WanCausalConv3d.forward
        original = self.forward

        def forward(conv, x, cache_x=None):
            if cache_x is not None or x.shape[2] != 1:
                return original(conv, x, cache_x)
            padding = (conv._padding[2], conv._padding[0])
            weight = conv.weight[:, :, -1]
            return torch.nn.functional.conv2d(x[:, :, 0], weight, conv.bias, conv.stride[1:], padding).unsqueeze(2)

        WanCausalConv3d.forward = forward

    def __exit__(self, *exc) -> None:
        self.cls.forward = self.forward


def decode_unclamped(vae, z: torch.Tensor) -> torch.Tensor:
    """`AutoencoderKLWan.decode` of one latent frame without its final clamp to [-1, 1]: a clamped output passes no
    gradient, so a decoder that starts out saturated (white where a shape should be) would never learn the shapes."""
    vae.clear_cache()
    vae._conv_idx = [0]
    out = vae.decoder(vae.post_quant_conv(z), feat_cache=vae._feat_map, feat_idx=vae._conv_idx, first_chunk=True)
    vae.clear_cache()
    return out


def train_vae(args: argparse.Namespace):
    with _SingleFrameConvs():
        return _train_vae(args)


def _train_vae(args: argparse.Namespace):
    from miles.data.moving_shapes import moving_shapes_items

    vae = framewise_vae(args).train()
    frames = frames_tensor(moving_shapes_items(args.vae_clips, seed=args.seed, split="train"))
    optimizer = torch.optim.AdamW(vae.parameters(), lr=args.vae_lr, weight_decay=0.0)  # no decay: zero taps stay 0
    warmup = 50
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min(1.0, (s + 1) / warmup) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * s / args.vae_steps))),
    )
    generator = torch.Generator().manual_seed(args.seed)
    started = time.perf_counter()
    for step in range(args.vae_steps):
        x = frames[torch.randint(len(frames), (args.vae_batch_size,), generator=generator)]
        posterior = vae.encode(x).latent_dist
        # the posterior mode, as miles encodes (`encode_images`); sampling it at the random init's unit variance
        # drowns the encoder's small means, and the decoder learns a blank canvas first (measured: loss stuck at 0.2)
        recon = decode_unclamped(vae, posterior.mode())
        kl = posterior.kl().mean() / posterior.mean[0].numel()
        # the shape's pixels weigh `--vae-ink-weight` times the white canvas's: most of a frame is canvas, and an
        # unweighted loss learns it first and the colours last (measured: colours still wrong after 400 steps)
        weight = 1 + (args.vae_ink_weight - 1) * (x < 0.99).any(dim=1, keepdim=True).float()
        error = weight * ((recon - x).abs() + (recon - x).pow(2))
        loss = error.mean() / weight.mean() + args.vae_kl_weight * kl
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 50 == 0 or step == args.vae_steps - 1:
            log(
                f"vae step {step}: loss {loss.item():.4f} kl/elem {kl.item():.3f} ({time.perf_counter() - started:.0f}s)"
            )
    return vae.eval().requires_grad_(False)


@torch.no_grad()
def calibrate_vae(vae, seed: int, num: int = 256) -> None:
    """Record the per-channel mean and std of posterior-mode latents of train clips (Wan's latents_mean/std)."""
    from miles.data.moving_shapes import moving_shapes_items

    clips = torch.stack([frames_tensor([item])[:, :, 0] for item in moving_shapes_items(num, seed=seed)])
    latents = torch.cat([vae.encode(chunk.permute(0, 2, 1, 3, 4)).latent_dist.mode() for chunk in clips.split(64)])
    per_channel = latents.transpose(0, 1).flatten(1)
    vae.register_to_config(
        latents_mean=[round(float(v), 6) for v in per_channel.mean(1)],
        latents_std=[round(float(v), 6) for v in per_channel.std(1)],
    )


@torch.no_grad()
def vae_ceiling(vae, seed: int, num: int = 200) -> dict[str, float]:
    """Moving-shapes metrics of VAE reconstructions of eval clips (whole clips through encode/decode): the best a
    generator on these latents can do."""
    from miles.data.moving_shapes import moving_shapes_items
    from miles.rollout.evaluation import moving_shapes_eval_metrics
    from miles.rollout.rm_hub.moving_shapes import moving_shapes_reward

    items = moving_shapes_items(num, seed=seed, split="eval")
    clips = torch.stack([frames_tensor([item])[:, :, 0] for item in items]).permute(0, 2, 1, 3, 4)  # (B, 3, F, H, W)
    recon = torch.cat([vae.decode(vae.encode(c).latent_dist.mode()).sample for c in clips.split(64)])
    uint8 = ((recon.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 4, 1).numpy()
    metrics = moving_shapes_eval_metrics(moving_shapes_reward(list(uint8), [item["metadata"] for item in items]))
    metrics["vae/psnr"] = float(10 * torch.log10(4 / (recon.clamp(-1, 1) - clips).pow(2).mean()))
    return metrics


# ---- stage 2: the transformer -----------------------------------------------------------------------------------------
def write_init_pipeline(args: argparse.Namespace, vae, path: Path) -> None:
    """The tiny Wan pipeline: the trained VAE, a random UMT5 knowing the world's words, a fresh transformer."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from miles.data.moving_shapes import NUM_FRAMES, RESOLUTION
    from miles.models.tiny import SHAPES_WORDS, build_t5_encoder, build_t5_tokenizer, eval_mode, save_tiny_folder

    tokenizer = build_t5_tokenizer(SHAPES_WORDS + WORDS)
    tokenizer.model_max_length = args.text_length
    torch.manual_seed(args.seed)
    text_dim = 32
    text_encoder = build_t5_encoder(tokenizer, text_dim, d_kv=8, config_class=UMT5Config, model_class=UMT5EncoderModel)
    channels = vae.config.z_dim
    transformer = WanTransformer3DModel(
        patch_size=(args.temporal_patch, args.patch, args.patch),
        num_attention_heads=args.heads,
        attention_head_dim=args.head_dim,
        in_channels=channels,
        out_channels=channels,
        text_dim=text_dim,
        freq_dim=64,
        ffn_dim=4 * args.heads * args.head_dim,
        num_layers=args.layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=64,
    )
    pipe = WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
        transformer=transformer,
    )
    shutil.rmtree(path, ignore_errors=True)
    save_tiny_folder(eval_mode(pipe), str(path), resolution=RESOLUTION, num_frames=NUM_FRAMES)
    params = sum(p.numel() for p in transformer.parameters())
    log(f"init pipeline at {path}: transformer {params / 1e6:.2f} M parameters")


def run_sft(args: argparse.Namespace, init_dir: Path, out_dir: Path) -> None:
    import train_diffusion
    from miles.data.moving_shapes import RESOLUTION
    from miles.utils.arguments import parse_args as parse_miles_args

    steps_per_rollout = 8
    miles_args = parse_miles_args(
        [
            "--loss-type", "sft_loss", "--train-only",
            "--hf-checkpoint", str(init_dir),
            "--prompt-data", "builtin:moving-shapes",
            "--builtin-dataset-size", str(args.sft_dataset_size),
            "--resolution", str(RESOLUTION),
            "--dp-size", "2",
            "--seed", str(args.seed), "--rollout-seed", str(args.seed),
            "--rollout-batch-size", str(args.sft_batch_size * steps_per_rollout),
            "--global-batch-size", str(args.sft_batch_size),
            "--num-steps-per-rollout", str(steps_per_rollout),
            "--micro-batch-size", str(args.sft_batch_size // 2),
            "--num-rollout", str(math.ceil(args.sft_steps / steps_per_rollout)),
            "--lr", str(args.sft_lr),
            "--sft-logit-mean", str(args.sft_logit_mean),
            "--lr-decay-style", "cosine",
            "--lr-warmup-steps", "50",
            "--min-lr", str(args.sft_lr * 0.05),
            "--save-hf", str(out_dir),
            "--output-dir", str(Path(args.workdir) / "sft"),
            "--log-level", "WARNING",  # the progress bar stays: SFT is most of the wall time
        ]
    )  # fmt: skip
    for folder in (out_dir, Path(args.workdir) / "sft"):  # the metrics writer appends to old files
        shutil.rmtree(folder, ignore_errors=True)
    summary = train_diffusion.run(miles_args)
    losses = summary["losses"]
    for start in range(0, len(losses), 100):
        log(
            f"sft steps {start}-{min(start + 100, len(losses)) - 1}: mean loss {np.mean(losses[start : start + 100]):.4f}"
        )
    log(
        f"sft: {len(losses)} steps in {summary['wall_s']:.0f}s; loss first 50 {np.mean(losses[:50]):.4f}, "
        f"last 50 {np.mean(losses[-50:]):.4f}"
    )


# ---- stage 3: evaluation ----------------------------------------------------------------------------------------------
def evaluate(args: argparse.Namespace, folder: Path) -> dict[str, float]:
    from miles.data.moving_shapes import RESOLUTION, moving_shapes_items
    from miles.rollout.engine import DiffusionEngine
    from miles.rollout.evaluation import evaluate_moving_shapes

    engine = DiffusionEngine(str(folder))
    records = moving_shapes_items(args.eval_prompts, seed=0, split="eval", clips=False)  # the runs' --eval-seed 0
    started = time.perf_counter()
    metrics, samples = evaluate_moving_shapes(
        engine, records, num_steps=args.eval_steps, guidance_scale=1.0, seed=0, resolution=RESOLUTION
    )
    log(
        f"eval {args.eval_prompts} clips, {args.eval_steps} ODE steps, CFG-free ({time.perf_counter() - started:.0f}s): "
        + ", ".join(f"{k.removeprefix('eval/moving_shapes_')} {v:.3f}" for k, v in metrics.items())
    )
    np.save(Path(args.workdir) / "eval_clips.npy", samples.images[:64])
    if args.media_out:
        write_docs_media(samples.images[:12], [r["prompt"] for r in records[:12]], Path(args.media_out))
    return metrics


def write_docs_media(clips: np.ndarray, prompts: list[str], out: Path, scale: int = 4, fps: float = 4.0) -> None:
    """The README's media of the first eval clips: each clip upscaled `scale` times with a grey frame around it;
    `moving_shapes_samples.png` (`contact_sheet`: a row per clip, all its frames across) and `moving_shapes_samples.mp4`
    (`write_mp4`: the clips tiled 4 wide, played three times at `fps`, slower than the family's 16 so the 5 frames
    can be followed), captions in `moving_shapes_samples.txt`."""
    from miles.rollout.media_files import contact_sheet, write_mp4

    big = clips.repeat(scale, axis=2).repeat(scale, axis=3)
    big = np.pad(big, ((0, 0), (0, 0), (2, 2), (2, 2), (0, 0)), constant_values=160)
    contact_sheet(big[:8], str(out / "moving_shapes_samples.png"), per_sample=big.shape[1])  # every frame
    columns = 4
    rows = [np.concatenate(list(big[r : r + columns]), axis=2) for r in range(0, len(big), columns)]  # (F, h, W, 3)
    grid = np.concatenate(rows, axis=1)
    write_mp4(str(out / "moving_shapes_samples.mp4"), np.concatenate([grid] * 3), fps)
    (out / "moving_shapes_samples.txt").write_text("".join(f"{i}: {p}\n" for i, p in enumerate(prompts)))
    log(f"wrote {out}/moving_shapes_samples.png, .mp4 and .txt")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    stages = set(args.stages.split(","))
    torch.set_num_threads(1)  # on a shared 2-core machine two threads oversubscribe (measured: 7x slower)
    started = time.perf_counter()
    report: dict = {"seed": args.seed, "args": vars(args)}
    vae_dir, init_dir, final_dir = workdir / "vae", workdir / "init", workdir / "final"
    if "vae" in stages:
        vae = train_vae(args)
        calibrate_vae(vae, args.seed)
        vae.save_pretrained(str(vae_dir), safe_serialization=True)
        report["vae_ceiling"] = vae_ceiling(vae, args.seed)
        log(f"vae: latents_mean {vae.config.latents_mean} std {vae.config.latents_std}")
        log(f"vae reconstructions of eval clips: {report['vae_ceiling']}")
        report["vae_s"] = time.perf_counter() - started
    if "sft" in stages:
        from diffusers import AutoencoderKLWan

        t0 = time.perf_counter()
        vae = AutoencoderKLWan.from_pretrained(str(vae_dir), local_files_only=True).eval()
        write_init_pipeline(args, vae, init_dir)
        run_sft(args, init_dir, final_dir)
        report["sft_s"] = time.perf_counter() - t0
    if "eval" in stages:
        t0 = time.perf_counter()
        report["eval"] = evaluate(args, final_dir if final_dir.is_dir() else init_dir)
        report["eval_s"] = time.perf_counter() - t0
    report["total_s"] = time.perf_counter() - started
    (workdir / "report.json").write_text(json.dumps(report, indent=2, default=str))
    if "sft" in stages and args.out:
        out = Path(args.out)
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(final_dir, out)
        log(f"copied the pipeline to {out}")
    log(f"done in {report['total_s']:.0f}s; report in {workdir / 'report.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
