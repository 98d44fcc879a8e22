"""Peak memory per trainer rank while loading and training a ≥400M-parameter SD3 transformer from a real diffusers
folder (random weights, saved with `save_pretrained`), side by side in one run: the trainer's sharded loading
(`sharded_load.load_sharded`: meta device, then each rank reads its rows) against a full load on every rank
(`from_pretrained`, then `fully_shard`: what the trainer did before), at dp 1, 2 and 4 on CPU, full and LoRA.

    python benchmarks/bench_load_memory.py                       # 12 layers x 16 heads x 64: 453M parameters
    python benchmarks/bench_load_memory.py --layers 4 --ranks 1,2 --modes sharded

Each configuration runs in fresh processes (one per rank, gloo). Memory is the process's resident set (Linux /proc,
after `malloc_trim`), measured above the rank's own baseline (its imports and process group, before any weight):
- load peak: the peak resident set from the start of loading to the sharded model;
- train peak: the peak over one forward, backward and AdamW step at 256 px (256 image tokens), batch 1.
Each is printed in GiB and as a multiple of the rank's share of the fp32 weights (the full model / dp); a rank that
held the full model at some point shows a load peak of at least dp shares. The design's target for LoRA: at most
1.5x the share, at every dp. Not a timed test.

    python benchmarks/bench_load_memory.py --engine              # a rollout engine's load instead (no trainer)

`--engine`: a rollout engine process (`DiffusionEngine` on CPU with its heap kept, as `EngineActor` starts) loading
the pipeline, its transformer in fp32 and cast to bf16: the engine's direct load (`load_transformer_direct`: meta
device, then each tensor read into its dtype and device) against what it did before (`from_pretrained(dtype)`, then
`.to(device)`). Printed: the load peak and the resident set after loading, above the process's baseline, in GiB and as
a multiple of the transformer's weights, and the resident set once every weight was read (a memory-mapped fp32
checkpoint's pages count only from then). The target: a load peak within 1.2x the weights.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from datetime import timedelta

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_memory import reset_peak, rss, trimmed_rss  # noqa: E402

from miles.backends.fsdp_utils.fsdp import apply_fsdp2  # noqa: E402
from miles.backends.fsdp_utils.lora import apply_lora  # noqa: E402
from miles.backends.fsdp_utils.sharded_load import load_sharded  # noqa: E402
from miles.utils.distributed import destroy_process_group, find_free_port, init_process_group  # noqa: E402

GIB = 2**30
LORA = {"r": 16, "lora_alpha": 16.0, "target_modules": ["to_q", "to_k", "to_v", "to_out.0"], "init_lora_weights": True}


def save_transformer_folder(folder: str, layers: int, heads: int, head_dim: int) -> int:
    """A diffusers SD3 pipeline folder (the tiny pipeline's other components) whose `transformer/` is an
    SD3-architecture transformer of the given size with random weights; its parameter count."""
    from diffusers import SD3Transformer2DModel

    from miles.models.sd3.tiny import save_tiny_sd3_pipeline

    save_tiny_sd3_pipeline(folder, seed=0)
    shutil.rmtree(os.path.join(folder, "transformer"))
    torch.manual_seed(0)
    model = SD3Transformer2DModel(
        sample_size=32,
        patch_size=2,
        in_channels=16,
        out_channels=16,
        num_layers=layers,
        attention_head_dim=head_dim,
        num_attention_heads=heads,
        joint_attention_dim=1024,
        caption_projection_dim=heads * head_dim,
        pooled_projection_dim=768,
        pos_embed_max_size=96,
    )
    model.save_pretrained(os.path.join(folder, "transformer"))
    return sum(p.numel() for p in model.parameters())


def rank_main(rank: int, world_size: int, port: int, opts: dict, out: str) -> None:
    from miles.models.sd3.sd3 import SD3PipelineConfig

    torch.set_num_threads(max(1, opts["threads"] // world_size))
    init_process_group(rank, world_size, "127.0.0.1", port, "cpu", timeout=timedelta(minutes=20))
    family = SD3PipelineConfig(opts["folder"])
    prepare = (lambda model: apply_lora(model, LORA)) if opts["lora"] else None

    def shard(model: torch.nn.Module) -> None:
        apply_fsdp2(
            model,
            list(model.transformer_blocks),
            param_dtype=torch.float32,
            reduce_dtype=torch.float32,
            cast_root_inputs=False,
        )

    baseline = trimmed_rss()
    reset_peak()
    if opts["mode"] == "sharded":
        model = load_sharded(
            family, None, dtype=torch.float32, device=torch.device("cpu"), shard=shard, prepare=prepare
        )
    else:  # every rank loads the whole network, then shards it
        model = family.load_transformer(None, dtype=torch.float32)
        if prepare is not None:
            prepare(model)
        shard(model)
    load_peak = rss("VmHWM") - baseline
    loaded = trimmed_rss() - baseline
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    gen = torch.Generator().manual_seed(rank)
    inputs = dict(
        hidden_states=torch.randn(1, 16, 32, 32, generator=gen),
        encoder_hidden_states=torch.randn(1, 77, 1024, generator=gen),
        pooled_projections=torch.randn(1, 768, generator=gen),
        timestep=torch.full((1,), 500.0),
    )
    reset_peak()
    model(**inputs, return_dict=False)[0].pow(2).mean().backward()
    optimizer.step()
    train_peak = rss("VmHWM") - baseline
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"load_peak": load_peak, "loaded": loaded, "train_peak": train_peak}, f)
    destroy_process_group()


def engine_main(_rank: int, opts: dict, out: str) -> None:
    """One engine process: the pipeline's load peak and resident sets above the process's baseline."""
    import miles.rollout.engine as engine_module
    from miles.models.base import get_train_pipeline_config
    from miles.utils.heap import keep_freed_memory

    torch.set_num_threads(opts["threads"])
    keep_freed_memory()  # as EngineActor does on CPU before it loads
    get_train_pipeline_config(opts["folder"])  # the family's imports, before the baseline
    if opts["loader"] == "from_pretrained":  # the engine's load before load_transformer_direct
        engine_module.load_transformer_direct = lambda family, *, dtype, device: family.load_transformer(
            dtype=dtype
        ).to(device)
    dtype = getattr(torch, opts["dtype"])
    baseline = trimmed_rss()
    reset_peak()
    engine = engine_module.DiffusionEngine(opts["folder"], forward_dtype=dtype)
    load_peak = rss("VmHWM") - baseline
    loaded = trimmed_rss() - baseline
    with torch.no_grad():
        for tensor in engine.transformer.state_dict().values():
            tensor.float().sum()  # reads every page (a mapped file's too)
    touched = trimmed_rss() - baseline
    weights = sum(t.numel() * t.element_size() for t in engine.transformer.state_dict().values())
    with open(os.path.join(out, "engine.json"), "w") as f:
        json.dump({"load_peak": load_peak, "loaded": loaded, "touched": touched, "weights": weights}, f)


def engine_table(opts: argparse.Namespace) -> None:
    print("| engine load | dtype | weights GiB | load peak GiB (x weights) | resident after load | after reading all |")
    print("|---|---|---|---|---|---|")
    for loader in ("direct", "from_pretrained"):
        for dtype in ("float32", "bfloat16"):
            with tempfile.TemporaryDirectory() as out:
                run_opts = {**vars(opts), "loader": loader, "dtype": dtype}
                mp.spawn(engine_main, args=(run_opts, out), nprocs=1)
                r = json.load(open(os.path.join(out, "engine.json")))
            w = r["weights"]
            print(
                f"| {loader} | {dtype} | {w / GIB:.2f} | {r['load_peak'] / GIB:.2f} ({r['load_peak'] / w:.2f}x) | "
                f"{r['loaded'] / GIB:.2f} ({r['loaded'] / w:.2f}x) | {r['touched'] / GIB:.2f} ({r['touched'] / w:.2f}x) |",
                flush=True,
            )


def measure(world_size: int, mode: str, lora: bool, opts: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as out:
        rank_opts = {**vars(opts), "mode": mode, "lora": lora}
        mp.spawn(rank_main, args=(world_size, find_free_port(), rank_opts, out), nprocs=world_size)
        reports = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(world_size)]
    return {key: max(r[key] for r in reports) for key in reports[0]}  # the worst rank


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12, help="SD3 joint blocks (12 x 16 heads x 64: 453M).")
    parser.add_argument("--heads", type=int, default=16, help="Attention heads.")
    parser.add_argument("--head-dim", type=int, default=64, help="Width of one head.")
    parser.add_argument("--ranks", default="1,2,4", help="Comma-separated dp sizes.")
    parser.add_argument("--modes", default="sharded,replica", help="sharded (the trainer) and/or replica (before).")
    parser.add_argument(
        "--replica-max-ranks", type=int, default=2, help="Largest dp for the replica mode (dp full copies at once)."
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="Torch threads over all ranks.")
    parser.add_argument("--engine", action="store_true", help="A rollout engine's load instead of the trainer's.")
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        opts.folder = folder
        params = save_transformer_folder(folder, opts.layers, opts.heads, opts.head_dim)
        weights = params * 4
        print(f"SD3 transformer: {params / 1e6:.0f}M parameters, {weights / GIB:.2f} GiB in fp32")
        if opts.engine:
            engine_table(opts)
            return
        print("| mode | weights | dp | share GiB | load peak GiB (x share) | loaded GiB | train peak GiB (x share) |")
        print("|---|---|---|---|---|---|---|")
        for mode in opts.modes.split(","):
            for lora in (True, False):
                for world_size in (int(n) for n in opts.ranks.split(",")):
                    if mode == "replica" and world_size > opts.replica_max_ranks:
                        continue
                    r = measure(world_size, mode, lora, opts)
                    share = weights / world_size
                    print(
                        f"| {mode} | {'LoRA' if lora else 'full'} | {world_size} | {share / GIB:.2f} | "
                        f"{r['load_peak'] / GIB:.2f} ({r['load_peak'] / share:.2f}x) | {r['loaded'] / GIB:.2f} | "
                        f"{r['train_peak'] / GIB:.2f} ({r['train_peak'] / share:.2f}x) |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
