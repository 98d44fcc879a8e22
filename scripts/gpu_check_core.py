"""The Ray-free steps of `scripts/gpu_check.sh --no-setup`, one per call, each ending with a `RESULT:` line:

    python scripts/gpu_check_core.py trainer_step --workdir DIR       # FSDP2 trainer, world size 1 (NCCL on CUDA)
    python scripts/gpu_check_core.py engine_generate --workdir DIR    # a rollout engine samples with CFG in micro-batches
    python scripts/gpu_check_core.py weight_sync --workdir DIR        # trainer -> engine in a second process (cuda_ipc)
    python scripts/gpu_check_core.py pinned_sizes                     # --colocate-sleep's host buffer, 1.1 GiB
    python scripts/gpu_check_core.py precision_parity --workdir DIR   # engine vs trainer log-probs in bf16

The trainer and the engine are called directly (`FSDPTrainRayActor.init` / `train_pairs` / `push_weights`,
`DiffusionEngine.generate` / `receive_weights`), on the tiny SD3 pipeline built into `--workdir` once. `--device cpu` runs the same code on a CPU (the test suite
does, with Ray made unimportable).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from miles.arguments.parser import parse_args  # noqa: E402
from miles.backends.fsdp_utils.actor import FSDPTrainRayActor  # noqa: E402
from miles.backends.fsdp_utils.first_window_guard import LOG_PROB_BOUNDS  # noqa: E402
from miles.diffusion.sde import sde_step  # noqa: E402
from miles.models.base import get_train_pipeline_config  # noqa: E402
from miles.rollout.engine import DiffusionEngine  # noqa: E402
from miles.rollout.engine_api import GenerateRequest  # noqa: E402
from miles.utils.distributed import find_free_port  # noqa: E402
from miles.utils.offload import HostSwap, host_offsets  # noqa: E402
from miles.utils.types import shard_pairs  # noqa: E402
from miles.weight_sync.transports import TransportSpec  # noqa: E402

GIB = 2**30
PROMPTS = ["a red circle on the left", "a blue square on the right", "a green triangle", "two yellow circles"]


def tiny_pipeline(workdir: str) -> str:
    """The tiny SD3 pipeline folder under `workdir`, built on first use (random weights, offline)."""
    from miles.models.sd3.tiny import save_tiny_sd3_pipeline

    path = os.path.join(workdir, "tiny_sd3")
    if not os.path.exists(os.path.join(path, "model_index.json")):
        save_tiny_sd3_pipeline(path, seed=0)
    return path


def trainer(pipeline: str, device: str, forward_dtype: str) -> FSDPTrainRayActor:
    """One trainer rank of world size 1 (no Ray): sft_loss, two optimizer windows of two micro-batches."""
    args = parse_args(
        ["--hf-checkpoint", pipeline, "--prompt-data", "builtin:shapes", "--loss-type", "sft_loss", "--train-only"]
        + ["--device", device, "--dp-size", "1", "--rollout-batch-size", "8", "--global-batch-size", "4"]
        + ["--num-steps-per-rollout", "2", "--micro-batch-size", "2", "--diffusion-forward-dtype", forward_dtype]
        + ["--log-level", "WARNING"]
    )
    actor = FSDPTrainRayActor(1, 0, "actor")
    actor.init(args, "127.0.0.1", find_free_port())
    return actor


def sft_pairs(pipeline: str) -> dict[str, torch.Tensor]:
    """Eight (x0, prompt encoding) pairs for `train_pairs` (sft_loss): random latents, the tiny text encoders'."""
    family = get_train_pipeline_config(pipeline)
    family.load_text_encoders()
    generator = torch.Generator().manual_seed(0)
    pairs = {
        "x0": torch.randn((8, *family.latent_shape()), generator=generator),
        **family.encode_prompts([PROMPTS[i % 4] for i in range(8)]).to(dtype=torch.float32).to_columns(),
    }
    return shard_pairs(pairs, 1)[0]


def trainer_step(opts: argparse.Namespace) -> str:
    pipeline = tiny_pipeline(opts.workdir)
    pairs = sft_pairs(pipeline)
    actor = trainer(pipeline, opts.device, "bf16" if opts.device == "cuda" else "fp32")
    try:
        started = time.perf_counter()
        actor.train_pairs(0, pairs)
        seconds = time.perf_counter() - started
        losses = [m["train/loss"] for m in actor.pop_metrics()]
    finally:
        actor.shutdown()
    if len(losses) != 2 or not all(torch.isfinite(torch.tensor(losses))):
        raise RuntimeError(f"expected two finite window losses, got {losses}")
    return f"2 optimizer windows in {seconds:.2f}s, losses {losses[0]:.4f} {losses[1]:.4f}"


def request(sde: bool) -> GenerateRequest:
    return GenerateRequest(
        prompts=PROMPTS,
        seeds=[1, 2, 3, 4],
        num_steps=4,
        guidance_scale=4.5 if not sde else 1.0,
        negative_prompt="",
        sde_type="sde" if sde else "ode",
        noise_level=0.7,
        trained_steps=[0, 1, 2] if sde else [],
    )


# micro-batched against one batch, relative to the largest latent value: a GPU picks its kernels by row count (and
# convolutions run in TF32 by default), so the two agree to rounding, not bit for bit; a sample that took another's
# noise or prompt would be off by the order of the values themselves
MICRO_BATCH_BOUND = 1e-2


def engine_generate(opts: argparse.Namespace) -> str:
    """The engine samples the prompts with CFG in one forward per step, then in micro-batches of 2 samples (CFG rows
    included: two forwards of 4 rows per step): each sample's noise is its own, so the samples agree."""
    engine = DiffusionEngine(tiny_pipeline(opts.workdir), device=opts.device, micro_batch_size=len(PROMPTS))
    whole = engine.generate(request(sde=False))
    engine.micro_batch_size = 2
    started = time.perf_counter()
    result = engine.generate(request(sde=False))
    seconds = time.perf_counter() - started
    images = result.images
    if images is None or len(images) != len(PROMPTS) or not torch.isfinite(result.final_latents).all():
        raise RuntimeError("the engine did not return one finite sample per prompt")
    gap = float((result.final_latents - whole.final_latents).abs().max() / whole.final_latents.abs().max())
    if not gap <= MICRO_BATCH_BOUND:
        raise RuntimeError(
            f"micro-batches of 2 differ from one batch by {gap:.3g} relative (bound {MICRO_BATCH_BOUND})"
        )
    same = "bit-identical" if gap == 0 else f"within {gap:.2g} relative"
    return f"{len(PROMPTS)} samples x 4 steps with CFG in micro-batches of 2 in {seconds:.2f}s, {same} to one batch"


SYNC_TIMEOUT_S = 60.0
SYNC_BUCKET_BYTES = 256 << 10  # small buckets: several in a sync, so each slot is written again within one


def weight_sync(opts: argparse.Namespace) -> str:
    """A trainer rank (world size 1) sends its weights to an engine in a second process over the transport a run
    picks when the engine shares the trainer's device: `cuda_ipc` on a GPU (the engine maps rank 0's persistent
    device buffer and copies each bucket into its parameters in place), `shm` on a CPU host (resident: the engine's
    parameters are views of the file every trainer rank writes). Two syncs, an optimizer window between them; each
    bucket checksummed on the way, and after each sync the engine's weights equal what the trainer exported."""
    kind = "cuda_ipc" if opts.device == "cuda" else "shm"
    dtype = "bf16" if opts.device == "cuda" else "fp32"
    pipeline = tiny_pipeline(opts.workdir)
    pairs = sft_pairs(pipeline)
    actor = trainer(pipeline, opts.device, dtype)
    context = mp.get_context("spawn")
    versions, answers = context.Queue(), context.Queue()
    child = None
    try:
        plan, opener, offsets = actor.prepare_weight_sync(kind, SYNC_BUCKET_BYTES, kind == "shm", True)
        spec = TransportSpec(
            kind, "127.0.0.1", find_free_port(), 2, plan.buffer_bytes, SYNC_TIMEOUT_S,
            shm_path=opener if kind == "shm" else None, offsets=offsets,
        )  # fmt: skip
        engine_args = (pipeline, opts.device, dtype, spec, plan, opener if kind == "cuda_ipc" else None)
        child = context.Process(target=sync_engine, args=(*engine_args, versions, answers), daemon=True)
        child.start()
        actor.open_weight_sync(spec)  # with the engine, which joins as it starts
        seconds, first = [], {}
        for version in (1, 2):
            if version == 2:
                actor.train_pairs(0, pairs)
            versions.put(version)
            seconds.append(actor.push_weights())
            expected = actor.export_weights()[0] or {}
            status, received, in_place = answers.get(timeout=SYNC_TIMEOUT_S)
            if status != "ok":
                raise RuntimeError(f"the engine failed in sync {version}: {received}")
            wrong = [name for name, tensor in expected.items() if not torch.equal(received[name], tensor.cpu())]
            if wrong or not in_place:
                raise RuntimeError(f"sync {version}: {len(wrong)} tensors differ ({wrong[:3]}), in place {in_place}")
            first = first or received
        if all(torch.equal(first[name], received[name]) for name in received):
            raise RuntimeError(
                "the optimizer window between the syncs changed no weight: the second sync proves nothing"
            )
        versions.put(None)
    finally:
        actor.shutdown()
        if child is not None:
            child.join(SYNC_TIMEOUT_S)
            if child.is_alive():
                child.kill()
    mb = plan.total_bytes / 1e6
    times = ", ".join(f"{s:.3f}" for s in seconds)
    return f"{kind}: 2 syncs of {mb:.1f} MB in {len(plan.buckets)} buckets ({times} s), the engine equal to the export"


def sync_engine(pipeline, device, dtype, spec, plan, opener, versions, answers) -> None:
    """The engine process of `weight_sync`: join the sync group, take each version the parent names, answer with
    its transformer's weights (on the CPU) and whether the parameters kept their storage."""
    try:
        forward = torch.bfloat16 if dtype == "bf16" else torch.float32
        engine = DiffusionEngine(pipeline, device=device, forward_dtype=forward)
        engine.open_weight_sync(spec, plan, 1, opener)
        pointers = {name: t.data_ptr() for name, t in engine.transformer.state_dict().items()}
        while (version := versions.get(timeout=SYNC_TIMEOUT_S)) is not None:
            engine.receive_weights(version)
            state = engine.transformer.state_dict()
            kept = pointers == {name: t.data_ptr() for name, t in state.items()}
            answers.put(
                ("ok", {name: t.detach().to("cpu", copy=True) for name, t in state.items()}, kept)
            )  # not the shm views
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which names the step's failure
        answers.put(("error", repr(exc), False))


def pinned_sizes(opts: argparse.Namespace) -> str:
    """Sleep 1.1 GiB (not a power of two) after a smaller sleep: the host buffer holds exactly the bytes moved,
    outside torch's caching pinned allocator, and the smaller buffer is gone."""
    device = torch.device(opts.device)
    sizes = [GIB // 40 * 4 + 4000 * k for k in range(11)]
    tensors = [torch.full((n // 4,), float(k), device=device) for k, n in enumerate(sizes)]
    cuda = device.type == "cuda"
    cached = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) if cuda else 0
    swap = HostSwap(device)
    swap.sleep(tensors[:5])
    swap.wake()
    swap.sleep(tensors)
    exact, held = host_offsets(sizes)[1], swap.host.numel()
    cached = (torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) if cuda else 0) - cached
    pinned = swap.host.is_pinned()
    swap.wake()
    swap.release()
    intact = all(torch.equal(t, torch.full_like(t, float(k))) for k, t in enumerate(tensors))
    if held != exact or cached != 0 or (cuda and not pinned) or not intact:
        raise RuntimeError(f"host buffer {held} bytes (exact {exact}), {cached} cached, pinned {pinned}, {intact=}")
    return f"{held / GIB:.4f} GiB held for {sum(sizes) / GIB:.4f} GiB moved, 0 cached by torch, pinned {pinned}"


def precision_parity(opts: argparse.Namespace) -> str:
    """The engine samples in bf16 with SDE steps recorded; the trainer's FSDP2 model (bf16 forward) recomputes each
    recorded step's log-prob: the mean gap must stay within the first-window guard's bf16 bound."""
    pipeline = tiny_pipeline(opts.workdir)
    dtype = "bf16"
    engine = DiffusionEngine(pipeline, device=opts.device, forward_dtype=torch.bfloat16)
    result = engine.generate(request(sde=True))
    del engine
    actor = trainer(pipeline, opts.device, dtype)
    gaps = []
    try:
        with torch.no_grad():
            for k, step in enumerate(result.trained_steps):
                gaps.append(recomputed_gap(actor, result, k, step, opts.device))
    finally:
        actor.shutdown()
    mean, bound = sum(gaps) / len(gaps), LOG_PROB_BOUNDS[dtype]
    if not mean <= bound:
        raise RuntimeError(f"mean |train - rollout| log-prob {mean:.3g} > the bf16 bound {bound:g}")
    return f"mean |train - rollout| log-prob {mean:.3g} (bf16 bound {bound:g}), per step {[f'{g:.2g}' for g in gaps]}"


def recomputed_gap(actor: FSDPTrainRayActor, result, k: int, step: int, device: str) -> float:
    n = len(PROMPTS)
    x = result.latents[:, k].to(device)
    sigma = result.sigmas[step].expand(n).to(device)
    velocity = actor.family.predict_velocity(actor.model, x, sigma, result.conditioning.to(device=device))
    out = sde_step(
        x,
        velocity.float(),
        sigma,
        result.sigmas[step + 1].expand(n).to(device),
        noise_level=0.7,
        sigma_max=float(result.sigmas[1]),
        prev_sample=result.next_latents[:, k].to(device),
    )
    return float((out.log_prob.cpu() - result.log_probs[:, k]).abs().mean())


STEPS = {f.__name__: f for f in (trainer_step, engine_generate, weight_sync, pinned_sizes, precision_parity)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=sorted(STEPS))
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--workdir", default="outputs/gpu_check", help="Where the tiny pipeline is built once.")
    opts = parser.parse_args(argv)
    os.makedirs(opts.workdir, exist_ok=True)
    print(f"RESULT: {STEPS[opts.step](opts)}", flush=True)


if __name__ == "__main__":
    main()
