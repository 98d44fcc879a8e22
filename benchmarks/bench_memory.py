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
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(
            {"state": state, "activations": activations, "peak": peak, "seconds": seconds, "params": num_params}, f
        )
    destroy_process_group()


def measure(world_size: int, checkpointing: bool, opts: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as out:
        rank_opts = {**vars(opts), "checkpointing": checkpointing}
        mp.spawn(rank_main, args=(world_size, find_free_port(), rank_opts, out), nprocs=world_size)
        reports = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(world_size)]
    return {key: max(r[key] for r in reports) for key in reports[0]}  # the worst rank


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6, help="SD3 joint blocks (6: 124M parameters).")
    parser.add_argument("--resolution", type=int, default=512, help="Image side in pixels (latents: side / 8).")
    parser.add_argument("--batch", type=int, default=1, help="Images per rank.")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="Torch threads over all ranks.")
    opts = parser.parse_args()
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


if __name__ == "__main__":
    main()
