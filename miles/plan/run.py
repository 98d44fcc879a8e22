"""`--plan`: simulate the run's engines and each trained role's ranks (`engine_sim.py`, `simulate.py`), check that the simulated ranks
issue the same collectives, and assemble the per-GPU picture (`report.py`)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import logging
import math
import multiprocessing
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from miles.algorithms import algorithm_of, role_settings
from miles.arguments.fsdp import trainer_world_size
from miles.plan.dataset_sim import dataset_window
from miles.plan.engine_sim import latent_shape, simulate_engine
from miles.plan.gpus import GpuSpec
from miles.plan.process import ProcessPlan, simulation_args
from miles.plan.simulate import simulate_trainer_rank, train_pairs_for_rank
from miles.plan.tracker import Collective
from miles.rollout.data_source import load_records
from miles.rollout.engine_api import GenerateResult
from miles.rollout.micro_batches import resolve_rollout_micro_batch_size
from miles.rollout.rollout_hub import rollout_spec_of
from miles.rollout.rollout_hub.spec import DatasetSpec
from miles.rollout.steps import select_rows
from miles.utils.json_column import fake_rows_decode_as
from miles.utils.types import num_pairs

logger = logging.getLogger(__name__)


class CollectiveMismatch(RuntimeError):
    """Two simulated ranks of one role issue different collectives: on GPUs the run would hang."""


@dataclass
class Simulation:
    """What the simulated processes measured: the engine and, per role, each simulated rank; FLOPs per call."""

    engine: ProcessPlan | None
    engine_rows: int  # samples in the simulated generate call
    engine_flops: float  # of that call (all its denoising steps, text encoding and decoding)
    window_samples: int = 0  # samples in one window of one data-parallel rank
    roles: dict[str, list[ProcessPlan]] = field(default_factory=dict)
    train_flops: dict[str, float] = field(default_factory=dict)  # one whole window on rank 0
    window: dict = field(default_factory=dict)  # one data-parallel rank's window of train pairs (fake)
    json_row: Any = None  # what each row of a JSON column of the window stands for (`metadata_stand_in`)
    engine_micro_batch: int = 0  # samples per forward in the engine
    forward_flops_per_sample: float = 0.0  # one transformer forward of one sample, as the engine measured it
    seconds: float = 0.0


def planned_device(args: argparse.Namespace) -> str:
    """The device the plan is for: CUDA GPUs unless the flags say `--device cpu` (a plan needs no GPU)."""
    return "cpu" if args.device == "cpu" else "cuda"


def plans_sleep(args: argparse.Namespace) -> bool:
    """Whether the run would have engines and trainer ranks take turns on their GPUs (`--colocate-sleep`)."""
    if args.colocate_sleep == "on":
        return True
    return args.colocate_sleep == "auto" and bool(args.colocate) and planned_device(args) == "cuda"


def engine_rows(args: argparse.Namespace) -> int:
    """Samples one engine generates in one call: its share of the rollout (or of a --generate-chunk-size chunk);
    it runs them --rollout-micro-batch-size at a time (`engine_micro_batch`)."""
    total = args.rollout_batch_size * args.n_samples_per_prompt
    chunk = min(total, args.generate_chunk_size or total)
    return math.ceil(chunk / max(1, args.rollout_num_engines))


def engine_micro_batch(args: argparse.Namespace, latent_shape: tuple[int, ...], rows: int) -> int:
    """The samples per forward an engine of the planned device runs (`--rollout-micro-batch-size`, auto as on it)."""
    guided = args.diffusion_guidance_scale > 1.0
    size = resolve_rollout_micro_batch_size(
        args.rollout_micro_batch_size, latent_shape=latent_shape, guided=guided, device_type=planned_device(args)
    )
    return rows if size is None else min(rows, size)


def simulated_ranks(args: argparse.Namespace, limit: int = 4) -> list[int]:
    """Rank 0, the last rank, and the first rank of each other shard group and sequence-parallel group, at most
    `limit` in all (rank 0 first: its memory is the one reported; the others are checked for the same collectives)."""
    world = trainer_world_size(args)
    ranks = [0, world - 1]
    shard = args.fsdp_shard_size or world
    ranks += list(range(shard, world, shard))
    if args.sp_size > 1:
        ranks += list(range(args.sp_size, world, args.sp_size))
    unique = list(dict.fromkeys(r for r in ranks if 0 <= r < world))
    return unique[:limit]


def simulate(
    args: argparse.Namespace,
    *,
    ranks: list[int] | None = None,
    reuse: Simulation | None = None,
    parts: tuple[str, ...] = ("engine", "trainer"),
) -> Simulation:
    """The engine's generate call, then each role's ranks (rank 0 first) on the first micro-batch of one window of
    pairs converted from it, its FLOPs scaled to the whole window; when the window has more, the peak of the train
    phase adds the gradients the first leaves (a second micro-batch computes beside them: its steady state). With `reuse`, the parts not named in `parts` are taken from that
    simulation (a re-plan of a change that touches only the trainer, or only the engines; "window": only the
    trainer's window, whose later phases, the weight sync, sleep and wake, hold the same state whatever the
    micro-batch or checkpointing, and are taken from `reuse`'s ranks)."""
    started = time.perf_counter()
    sim = simulation_args(args)
    algorithm = algorithm_of(args)
    window_samples = max(1, sim.global_batch_size // args.dp_size)
    rows = engine_rows(args) if algorithm.uses_engines else window_samples
    engine: ProcessPlan | None
    spec = rollout_spec_of(sim)
    if isinstance(spec, DatasetSpec) and (reuse is None or "engine" in parts):  # no engine: the dataset's pairs
        engine, engine_flops, micro, json_row = None, 0.0, 0, {}
        window, forward_flops = dataset_window(sim, spec, window_samples)
    elif reuse is None or "engine" in parts:
        micro = engine_micro_batch(args, latent_shape(sim), rows)
        engine, result, samples, engine_flops = simulate_engine(sim, rows, micro_batch_size=micro)
        window = train_pairs_for_rank(sim, *reversed(_rows_for_window(result, samples, window_samples)))
        forward_flops = engine.forward_flops_per_sample
        json_row = metadata_stand_in(sim)
    else:
        engine, engine_flops, window, rows = reuse.engine, reuse.engine_flops, reuse.window, reuse.engine_rows
        micro, forward_flops, json_row = reuse.engine_micro_batch, reuse.forward_flops_per_sample, reuse.json_row
    out = Simulation(engine if algorithm.uses_engines else None, rows, engine_flops, window_samples=window_samples)
    out.engine_micro_batch, out.forward_flops_per_sample = micro, forward_flops
    out.window, out.json_row = window, json_row
    if reuse is not None and "trainer" not in parts and "window" not in parts:
        out.roles, out.train_flops = reuse.roles, reuse.train_flops
    else:
        after_window = reuse if reuse is not None and "trainer" not in parts else None
        with fake_rows_decode_as(json_row):
            simulate_roles(args, sim, window, out, ranks, after_window)
    out.seconds = time.perf_counter() - started
    return out


def metadata_stand_in(args: argparse.Namespace) -> dict[str, Any]:
    """What each row of the window's metadata column stands for: the rollout sides write each sample's prompt
    metadata and prompt there, which a differentiable reward scores against; the simulated samples' prompts are
    placeholders, so it is the first record of --prompt-data's (read only for a run that scores a reward in the
    trainer)."""
    if not algorithm_of(args).differentiable_reward(args):
        return {}
    record = load_records(args, with_images=False, resolution=None)[0]
    return {**(record.get("metadata") or {}), "prompt": record["prompt"]}


def simulate_roles(
    args: argparse.Namespace,
    sim: argparse.Namespace,
    window: dict,
    out: Simulation,
    ranks: list[int] | None,
    after_window: Simulation | None = None,
) -> None:
    """Each role's simulated ranks into `out` (in training order: each role's rank-0 output is the next one's
    peer, as dmd2's critic feeds its actor). Rank 0 runs here; the others, which are simulated only to compare
    their collectives and memory, run meanwhile in forked processes on the other cores (`_forked_ranks`)."""
    sleeps, peer, world = plans_sleep(args), None, trainer_world_size(args)
    roles = algorithm_of(args).role_names
    for role in roles:
        micro = role_settings(sim, role)["micro_batch_size"]
        simulated = min(num_pairs(window), micro)
        pairs = {key: value[:simulated] for key, value in window.items()}
        first, *others = ranks if ranks is not None else simulated_ranks(args)
        later = after_window.roles[role][0] if after_window is not None else None
        run = functools.partial(
            simulate_trainer_rank,
            sim,
            role,
            world_size=world,
            pairs=pairs,
            peer_output=peer,
            sleeps=sleeps,
            export=out.engine is not None,  # no engines (dataset pairs): no weight sync
            after_window=later,
            window=window if len(roles) == 1 else None,  # a start-up copy for re-plans (`copies`)
        )
        with _forked_ranks(others, functools.partial(_plan_only, run)) as collect:
            plan, peer = run(rank=first)
            out.roles[role] = [plan, *collect()]
        out.train_flops[role] = window_flops(args, out.forward_flops_per_sample, plan, num_pairs(window), role)
        for each in out.roles[role]:
            each.peaks["train"] = steady_train_peak(each, later_micro_batches=num_pairs(window) > simulated)


def steady_train_peak(plan: ProcessPlan, later_micro_batches: bool) -> int:
    """The train phase's peak in any window of the run, from the first one simulated: from the second window on,
    the forwards and backwards run beside AdamW's moments (the first step allocates them), and a later micro-batch
    of a window beside the gradients the first left; the optimizer step's own peak is the first window's."""
    forward_backward = plan.before_step_bytes + plan.optimizer_bytes
    if later_micro_batches:
        forward_backward += plan.grads_bytes
    return max(plan.peaks["train"], forward_backward)


@contextlib.contextmanager
def _forked_ranks(ranks: list[int], simulate_rank: Callable[[int], ProcessPlan]) -> Iterator[Callable]:
    """Simulate `ranks` in children forked now, before the caller simulates rank 0, so that each starts from the
    same clean state (torch keeps device meshes it met: a second simulation in one process would find rank 0's mesh
    groups in its own); they all run at once, beside rank 0, sharing the machine's cores (3 equal ranks on 2 cores
    all end after 1.5 ranks' time; taking turns on the core rank 0 leaves, the last ended after 2). Yields `collect`,
    which returns their plans in order. With other threads alive (a fork copies a lock another thread may hold: the
    child would wait on it forever) they run in this process after rank 0, which a 2-D mesh (--fsdp-shard-size)
    does not survive."""
    _stop_tqdm_monitor()
    forkable = threading.active_count() == 1
    if ranks and not forkable:
        others = [t.name for t in threading.enumerate() if t is not threading.current_thread()]
        logger.info("simulating ranks %s in this process after rank 0 (threads alive: %s)", ranks, others)
    context = multiprocessing.get_context("fork")
    pending: dict[int, tuple[Any, Any]] = {}
    for rank in ranks if forkable else []:
        receive, send = context.Pipe(duplex=False)
        process = context.Process(target=_child, args=(simulate_rank, rank, send), daemon=True)
        process.start()
        pending[rank] = (process, receive)

    def collect() -> list[ProcessPlan]:
        plans = []
        for rank in ranks:
            if rank not in pending:
                plans.append(simulate_rank(rank))
                continue
            process, receive = pending[rank]
            result = receive.recv()
            process.join()
            if isinstance(result, BaseException):
                raise result
            plans.append(result)
        return plans

    yield collect


def _stop_tqdm_monitor() -> None:
    """End tqdm's monitor threads (the first progress bar of a tqdm class starts one, diffusers' "Loading pipeline
    components" among them) and start no other: they only re-time slow bars, and while one lives no rank may be
    forked."""
    import tqdm
    from tqdm._monitor import TMonitor

    tqdm.tqdm.monitor_interval = 0  # every tqdm class inherits it
    for thread in threading.enumerate():
        if isinstance(thread, TMonitor):
            thread.exit()
            thread.join(timeout=5)


def window_flops(
    args: argparse.Namespace, forward_per_pair: float, plan: ProcessPlan, pairs: int, role: str = "actor"
) -> float:
    """One window's FLOPs on a rank from its forwards per micro-batch (`plan.passes`): each with gradients costs
    itself, its backward twice as much and, under activation checkpointing, its recompute once more; each without
    gradients (a frozen network's) itself. A pair's forward costs what the engine's forward of a sample measured.
    With `--diffusion-recompute-old-log-prob`, windows 1.. of a rollout are first run forward once more without
    gradients (the recompute loop): their share of it is added to each window (the simulated rollout has one)."""
    grad, no_grad = plan.passes.get("grad", 0), plan.passes.get("no_grad", 0)
    flops = forward_per_pair * pairs * (grad * (4 if args.gradient_checkpointing else 3) + no_grad)
    windows = role_settings(args, role)["num_steps_per_rollout"] or args.num_steps_per_rollout
    if algorithm_of(args).log_prob_ratio and args.diffusion_recompute_old_log_prob and windows > 1:
        flops += forward_per_pair * pairs * (grad + no_grad) * (windows - 1) / windows
    return flops


def _plan_only(run: Callable[..., tuple[ProcessPlan, Any]], rank: int) -> ProcessPlan:
    return run(rank=rank)[0]


def _child(simulate_rank: Callable[[int], ProcessPlan], rank: int, send: Any) -> None:
    try:
        send.send(simulate_rank(rank))
    except BaseException as exc:  # noqa: BLE001 - handed to the parent, which raises it
        send.send(RuntimeError(f"simulating rank {rank}: {type(exc).__name__}: {exc}"))
    finally:
        send.close()


def _rows_for_window(result: GenerateResult, samples: list, count: int) -> tuple[GenerateResult, list]:
    """The engine's result stretched or cut to the `count` samples of one rank's window (the trainer's input shapes
    depend on the sample count only). Simulated media (`Media.pixels_uint8`: a broadcast zero that takes no memory)
    stay a broadcast of `count` rows: indexing or joining them would write out every frame (GBs for a video)."""
    images = result.images
    broadcast = images if images is not None and images.size > 0 and not any(images.strides) else None  # one value
    if broadcast is not None:
        result = dataclasses.replace(result, images=None)
    if result.batch_size >= count:
        window, rows = select_rows(result, range(count)), samples[:count]
    else:
        copies = math.ceil(count / result.batch_size)
        window = select_rows(GenerateResult.concat([result] * copies), range(count))
        rows = [samples[i % len(samples)] for i in range(count)]
    if broadcast is not None:
        one = np.asarray(broadcast[(0,) * broadcast.ndim])
        window = dataclasses.replace(window, images=np.broadcast_to(one, (count, *broadcast.shape[1:])))
    return window, rows


def check_collectives(simulation: Simulation) -> None:
    """Every simulated rank of a role issues rank 0's collectives, in order (op, group size, dtype, elements);
    the first divergence raises `CollectiveMismatch`, naming both ranks and the collective."""
    for role, plans in simulation.roles.items():
        reference = plans[0]
        for other in plans[1:]:
            mismatch = first_divergence(reference.collectives, other.collectives)
            if mismatch is not None:
                index, mine, theirs = mismatch
                raise CollectiveMismatch(
                    f"{role} rank {reference.rank} and rank {other.rank} diverge at collective #{index}: "
                    f"{describe_collective(mine)} vs {describe_collective(theirs)}; on GPUs this run would hang"
                )


def first_divergence(
    mine: list[Collective], theirs: list[Collective]
) -> tuple[int, Collective | None, Collective | None] | None:
    """The first index where two ranks' collectives differ (a missing one counts), or None."""
    for index in range(max(len(mine), len(theirs))):
        a = mine[index] if index < len(mine) else None
        b = theirs[index] if index < len(theirs) else None
        key_a = None if a is None else (a.op, a.group_size, a.dtype, a.numel)
        key_b = None if b is None else (b.op, b.group_size, b.dtype, b.numel)
        if key_a != key_b:
            return index, a, b
    return None


def describe_collective(collective: Collective | None) -> str:
    return "none (the rank issues no more)" if collective is None else collective.describe()


@dataclass(frozen=True)
class PlanSettings:
    """What the plan is measured against: the GPU, the sustained TFLOPs per GPU and the interconnect for the sync."""

    gpu: GpuSpec
    tflops: float
    interconnect_gbps: float
