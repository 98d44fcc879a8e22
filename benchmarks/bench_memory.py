"""Peak memory per rank of one FSDP2 training step of a ≥100M-parameter SD3 transformer (random weights from a
config), side by side in one run: dp size 1 vs 2, and with vs without --gradient-checkpointing, on CPU.

    python benchmarks/bench_memory.py                   # 124M parameters, 512 px (1024 image tokens), batch 1
    python benchmarks/bench_memory.py --layers 8 --resolution 256

Each configuration runs in fresh processes (one per rank, gloo). The model is built on the meta device, sharded,
then materialised: no rank ever holds the full model. Memory is the process's resident set (Linux /proc), after
`malloc_trim` so that freed memory is returned:
- state: RSS after the optimizer step (parameters, gradients, AdamW moments) minus RSS before the model;
- activations: RSS after the forward minus RSS before it: what the forward keeps for backward (at dp 2 the blocks
  reshard after forward, so this is activations; at dp 1 the one root group also keeps its gathered parameters);
- step peak: the peak RSS of forward + backward minus RSS before the forward.
It prints both and the two ratios the design asks for (state ws2 / ws1 ≤ 0.6; activations with / without
checkpointing ≤ 0.5, at dp 2). Not a timed test: step times are printed for information only.

    python benchmarks/bench_memory.py --sp              # sequence parallelism: a Wan transformer, a long clip

`--sp` compares, on the same ranks (as many as the largest of `--sp-sizes`, default 1,2,4: four), --sp-size 1 (dp 4:
each rank a whole sample) with --sp-size 2 (dp 2) and --sp-size 4 (dp 1: one sample's tokens split over all four,
miles.models.wan.sequence_parallel): the same parameter shards per rank, so the activations per rank differ by what
sequence parallelism saves (target: sp 2 ≤ 0.6x sp 1).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from miles.backends.fsdp_utils.fsdp import apply_fsdp2  # noqa: E402
from miles.models.sequence_parallel import new_sequence_parallel_group  # noqa: E402
from miles.models.wan.sequence_parallel import shard_wan_sequence  # noqa: E402
from miles.utils.distributed import destroy_process_group, find_free_port, init_process_group  # noqa: E402

MIB = 2**20


def sd3_config(layers: int, resolution: int) -> dict:
    """SD3-architecture transformer, 768 wide (12 heads of 64), 16 latent channels, patch 2; 6 layers: 124M."""
    return dict(
        sample_size=resolution // 8,
        patch_size=2,
        in_channels=16,
        out_channels=16,
        num_layers=layers,
        attention_head_dim=64,
        num_attention_heads=12,
        joint_attention_dim=1024,
        caption_projection_dim=768,
        pooled_projection_dim=768,
        pos_embed_max_size=max(96, resolution // 16),
    )


def rss(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status (Linux only)")


def trimmed_rss() -> int:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return rss()


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def rank_main(rank: int, world_size: int, port: int, opts: dict, out: str) -> None:
    from diffusers import SD3Transformer2DModel

    torch.set_num_threads(max(1, opts["threads"] // world_size))
    init_process_group(rank, world_size, "127.0.0.1", port, "cpu", timeout=timedelta(minutes=10))
    torch.manual_seed(0)
    config = sd3_config(opts["layers"], opts["resolution"])
    before = trimmed_rss()
    with torch.device("meta"):
        model = SD3Transformer2DModel(**config)
    model.train()
    apply_fsdp2(
        model,
        list(model.transformer_blocks),
        param_dtype=torch.float32,
        reduce_dtype=torch.float32,
        cast_root_inputs=False,
        gradient_checkpointing=opts["checkpointing"],
    )
    model.to_empty(device="cpu")
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02)
    num_params = sum(p.numel() for p in model.parameters())  # DTensor numel: the full size
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    side = opts["resolution"] // 8
    gen = torch.Generator().manual_seed(rank)
    inputs = dict(
        hidden_states=torch.randn(opts["batch"], 16, side, side, generator=gen),
        encoder_hidden_states=torch.randn(opts["batch"], 77, 1024, generator=gen),
        pooled_projections=torch.randn(opts["batch"], 768, generator=gen),
        timestep=torch.full((opts["batch"],), 500.0),
    )

    measured_step(model, inputs, optimizer, before, num_params, os.path.join(out, f"rank{rank}.json"))
    destroy_process_group()


def measured_step(model, inputs: dict, optimizer, before: int, num_params: int, path: str) -> None:
    """One forward, backward and optimizer step; writes the rank's report to `path`: resident bytes of the state
    (above `before`, the process before the model), of the activations the forward keeps for backward, the step's
    peak, its seconds and the parameter count."""
    start = trimmed_rss()
    reset_peak()
    started = time.perf_counter()
    loss = model(**inputs, return_dict=False)[0].float().pow(2).mean()
    activations = trimmed_rss() - start  # what the forward keeps for backward
    loss.backward()
    peak = rss("VmHWM") - start
    optimizer.step()
    seconds = time.perf_counter() - started
    del loss
    state = trimmed_rss() - before
    with open(path, "w") as f:
        json.dump(
            {"state": state, "activations": activations, "peak": peak, "seconds": seconds, "params": num_params}, f
        )


def wan_config(layers: int) -> dict:
    """Wan-architecture transformer, 512 wide (8 heads of 64), 16 latent channels, patch 1x2x2."""
    return dict(
        patch_size=(1, 2, 2),
        num_attention_heads=8,
        attention_head_dim=64,
        in_channels=16,
        out_channels=16,
        text_dim=512,
        freq_dim=256,
        ffn_dim=2048,
        num_layers=layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
    )


def wan_rank_main(rank: int, world_size: int, port: int, opts: dict, out: str) -> None:
    """One training step of a Wan transformer on `world_size` ranks, a sample per group of sp_size ranks (sp_size 1:
    a sample per rank) split over the group; the same report as `rank_main`."""
    from diffusers import WanTransformer3DModel

    torch.set_num_threads(max(1, opts["threads"] // world_size))
    init_process_group(rank, world_size, "127.0.0.1", port, "cpu", timeout=timedelta(minutes=10))
    sp = new_sequence_parallel_group(opts["sp_size"])
    before = trimmed_rss()
    with torch.device("meta"):
        model = WanTransformer3DModel(**wan_config(opts["layers"]))
    model.train()
    if sp is not None:
        shard_wan_sequence(model, sp)
    apply_fsdp2(
        model, list(model.blocks), param_dtype=torch.float32, reduce_dtype=torch.float32, cast_root_inputs=False
    )
    model.to_empty(device="cpu")
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02)
    num_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    side = opts["resolution"] // 8
    gen = torch.Generator().manual_seed(rank // opts["sp_size"])  # an sp group shares its sample
    inputs = dict(
        hidden_states=torch.randn(1, 16, opts["frames"], side, side, generator=gen),
        encoder_hidden_states=torch.randn(1, 64, 512, generator=gen),
        timestep=torch.full((1,), 500.0),
    )
    measured_step(model, inputs, optimizer, before, num_params, os.path.join(out, f"rank{rank}.json"))
    destroy_process_group()


def measure(world_size: int, checkpointing: bool, opts: argparse.Namespace, main_fn=rank_main, **extra) -> dict:
    with tempfile.TemporaryDirectory() as out:
        rank_opts = {**vars(opts), "checkpointing": checkpointing, **extra}
        mp.spawn(main_fn, args=(world_size, find_free_port(), rank_opts, out), nprocs=world_size)
        reports = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(world_size)]
    return {key: max(r[key] for r in reports) for key in reports[0]}  # the worst rank


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6, help="SD3 joint blocks (6: 124M parameters).")
    parser.add_argument("--resolution", type=int, default=512, help="Image side in pixels (latents: side / 8).")
    parser.add_argument("--batch", type=int, default=1, help="Images per rank.")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="Torch threads over all ranks.")
    parser.add_argument("--sp", action="store_true", help="The sequence-parallel sides instead (Wan).")
    parser.add_argument(
        "--sp-sizes", default="1,2,4", help="--sp: the --sp-size values compared, on as many ranks as the largest."
    )
    parser.add_argument("--frames", type=int, default=4, help="--sp: latent frames of the clip.")
    opts = parser.parse_args()
    if opts.sp:
        main_sp(opts)
        return
    runs = {
        "dp 1": measure(1, False, opts),
        "dp 2": measure(2, False, opts),
        "dp 2 + checkpointing": measure(2, True, opts),
    }
    params = runs["dp 1"]["params"]
    print(f"SD3 transformer {params / 1e6:.0f}M parameters, {opts.resolution} px, batch {opts.batch} per rank, CPU")
    print(f"{'MiB per rank':<24}{'state':>8}{'activations':>13}{'step peak':>11}{'step s':>8}")
    for name, r in runs.items():
        row = f"{r['state'] / MIB:>8.0f}{r['activations'] / MIB:>13.0f}{r['peak'] / MIB:>11.0f}{r['seconds']:>8.1f}"
        print(f"{name:<24}{row}")
    state_ratio = runs["dp 2"]["state"] / runs["dp 1"]["state"]
    act_ratio = runs["dp 2 + checkpointing"]["activations"] / runs["dp 2"]["activations"]
    print(f"state per rank dp 2 / dp 1 = {state_ratio:.2f}  (target ≤ 0.6)")
    print(f"activations with / without checkpointing = {act_ratio:.2f}  (target ≤ 0.5)")


def main_sp(opts: argparse.Namespace) -> None:
    """Each of --sp-sizes on the same ranks (dp x sp = the largest size): per-rank memory of one step
    (`wan_rank_main`)."""
    sizes = sorted({int(n) for n in opts.sp_sizes.split(",")})
    world = sizes[-1]
    if sizes[0] != 1 or any(world % n for n in sizes):
        raise SystemExit(f"--sp-sizes {opts.sp_sizes}: needs 1 and sizes that divide the largest")
    runs = {n: measure(world, False, opts, wan_rank_main, sp_size=n) for n in sizes}
    side = opts.resolution // 16
    tokens = opts.frames * side * side
    print(f"Wan transformer {runs[1]['params'] / 1e6:.0f}M parameters, {tokens} tokens per sample, {world} ranks, CPU")
    print(f"{'MiB per rank':<24}{'state':>8}{'activations':>13}{'step peak':>11}{'step s':>8}")
    for n, r in runs.items():
        row = f"{r['state'] / MIB:>8.0f}{r['activations'] / MIB:>13.0f}{r['peak'] / MIB:>11.0f}{r['seconds']:>8.1f}"
        print(f"{f'sp {n} (dp {world // n})':<24}{row}")
    for n in sizes[1:]:
        ratio = runs[n]["activations"] / runs[1]["activations"]
        target = "  (target ≤ 0.6)" if n == 2 else ""
        print(f"activations per rank sp {n} / sp 1 = {ratio:.2f}{target}")


if __name__ == "__main__":
    main()
