"""What a plan says (`plan.json`, docs/user-guide/memory.md#the-planner): each role's peak per GPU and what it is made
of, each GPU's roles added up phase by phase (colocated ones share a GPU), the host memory pinned per node, the sync
bytes, FLOPs and time estimates, and the verdict against the GPU."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any, TypedDict

from miles.algorithms import algorithm_of
from miles.arguments.fsdp import trainer_world_size
from miles.plan.process import ProcessPlan
from miles.plan.run import PlanSettings, Simulation, plans_sleep
from miles.weight_sync.transports import SLOTS

GPUS_PER_NODE = 8
PHASES = ("start-up", "train", "generate", "weight sync")


class GpuEntry(TypedDict):
    """One GPU of the plan (`plan.json`'s `gpus` and `worst_gpu`): its processes and its peak phase."""

    index: int
    roles: list[str]
    peak_bytes: int
    phase: str


@dataclass(frozen=True)
class Component:
    """One process's share of a GPU: what it holds at rest and at its peak in each phase it is active."""

    label: str
    kind: str  # a role name, or "engine"
    plan: ProcessPlan
    offload: bool = False  # --fsdp-cpu-offload: its parameters, gradients and optimizer state live on the host
    extra_bytes: int = 0  # held on the device beside what it simulated (an NCCL engine's bucket receive buffer)

    def _device(self, value: int) -> int:
        held_on_host = self.plan.params_bytes + self.plan.grads_bytes + self.plan.optimizer_bytes
        return (max(0, value - held_on_host) if self.offload else value) + self.extra_bytes

    def resident(self) -> int:
        phase = "start-up" if self.kind == "engine" else "train"
        return self._device(self.plan.after.get(phase, self.plan.after.get("start-up", 0)))

    def peak(self, phase: str) -> int:
        name = "train" if phase == "train" else phase
        return self._device(self.plan.peaks.get(name, 0)) if name in self.plan.peaks else self.resident()


def role_entry(plan: ProcessPlan, offload: bool, extra_bytes: int = 0) -> dict[str, Any]:
    component = Component(plan.name, plan.name, plan, offload, extra_bytes)
    peak_phase = plan.peak_phase
    return {
        "peak_bytes": component.peak(peak_phase),
        "phase": peak_phase,
        "params_bytes": plan.params_bytes,
        "grads_bytes": plan.grads_bytes,
        "optimizer_bytes": plan.optimizer_bytes,
        "other_state_bytes": plan.other_state_bytes,
        "activations_bytes": plan.activations_bytes,
        "host_offload_bytes": plan.params_bytes + plan.grads_bytes + plan.optimizer_bytes if offload else 0,
        "sync_buffer_bytes": plan.sync_buffer_bytes + extra_bytes,
        "simulated_ranks": [],
    }


def gpu_components(args: argparse.Namespace, simulation: Simulation) -> list[list[Component]]:
    """Each GPU's processes: with --colocate GPU i holds rank i of every role and engines i, i + dp, ...; otherwise
    each role's ranks and the engines have GPUs of their own (engines sharing one with --rollout-gpus-per-engine
    below 1)."""
    world, offload = trainer_world_size(args), bool(args.fsdp_cpu_offload)

    def rank_component(role: str, rank: int) -> Component:
        plans = simulation.roles[role]
        plan = plans[0] if rank == 0 else plans[-1]  # rank 0 gathers the engines' weights; the others alike
        return Component(f"{role} rank {rank}", role, plan, offload)

    engines = []
    if simulation.engine is not None and not args.train_only:
        # apart from trainer rank 0's GPU (nccl) an engine receives each bucket into a buffer of its own
        receive = 0 if args.colocate else engine_receive_bytes(simulation)
        engines = [
            Component(f"engine {e}", "engine", simulation.engine, extra_bytes=receive)
            for e in range(args.rollout_num_engines)
        ]
    if args.colocate:
        gpus = [[rank_component(role, rank) for role in simulation.roles] for rank in range(world)]
        for index, engine in enumerate(engines):
            gpus[index % world].append(engine)
        return gpus
    gpus = [[rank_component(role, rank)] for role in simulation.roles for rank in range(world)]
    per_gpu = max(1, round(1 / args.rollout_gpus_per_engine)) if args.rollout_gpus_per_engine < 1 else 1
    for start in range(0, len(engines), per_gpu):
        gpus.append(engines[start : start + per_gpu])
    return gpus


def engine_receive_bytes(simulation: Simulation) -> int:
    """One bucket slot: what an engine on a GPU of its own holds for the `nccl` weight sync (trainer rank 0 holds
    `SLOTS` of them, in its own plan)."""
    actor = simulation.roles.get("actor")
    return actor[0].sync_buffer_bytes // SLOTS if actor else 0


def gpu_peaks(components: list[Component], sleeps: bool) -> dict[str, int]:
    """A GPU's bytes at the peak of each phase: the process active in it at its peak, the others at rest (or
    asleep: nothing on the device, with --colocate-sleep)."""
    trainers = [c for c in components if c.kind != "engine"]
    engines = [c for c in components if c.kind == "engine"]
    out = {}
    startup_rest = sum(c.resident() for c in components)
    out["start-up"] = startup_rest + max((c.peak("start-up") - c.resident() for c in components), default=0)
    if trainers:
        engines_rest = 0 if sleeps else sum(c.resident() for c in engines)
        out["train"] = engines_rest + max(
            c.peak("train") + sum(o.resident() for o in trainers if o is not c) for c in trainers
        )
    if engines:
        trainers_rest = 0 if sleeps else sum(c.resident() for c in trainers)
        out["generate"] = trainers_rest + sum(c.peak("generate") for c in engines)
    sync = [c for c in trainers if "weight sync" in c.plan.peaks]
    if sync:
        out["weight sync"] = sum(c.resident() for c in engines) + max(
            c.peak("weight sync") + sum(o.resident() for o in trainers if o is not c) for c in sync
        )
    return out


def host_pinned_per_node(gpus: list[list[Component]], sleeps: bool) -> int:
    """The largest node's page-locked host memory: the sleep buffers (with --colocate-sleep) and the CPU-offloaded
    state of its GPUs' processes."""
    per_gpu = []
    for components in gpus:
        total = 0
        for c in components:
            if c.offload:
                total += c.plan.params_bytes + c.plan.grads_bytes + c.plan.optimizer_bytes
            if sleeps:
                total += c.plan.host_bytes if c.kind != "engine" else c.resident()
        per_gpu.append(total)
    nodes = [per_gpu[i : i + GPUS_PER_NODE] for i in range(0, len(per_gpu), GPUS_PER_NODE)]
    return max((sum(node) for node in nodes), default=0)


def build_report(args: argparse.Namespace, simulation: Simulation, settings: PlanSettings) -> dict[str, Any]:
    """The plan as `plan.json` holds it (schema: docs/user-guide/memory.md)."""
    sleeps = plans_sleep(args)
    gpus = gpu_components(args, simulation)
    gpu_entries: list[GpuEntry] = []
    for index, components in enumerate(gpus):
        peaks = gpu_peaks(components, sleeps)
        phase = max(peaks, key=peaks.__getitem__)
        gpu_entries.append(
            {"index": index, "roles": [c.label for c in components], "peak_bytes": peaks[phase], "phase": phase}
        )
    roles = {}
    for role, plans in simulation.roles.items():
        roles[role] = role_entry(plans[0], bool(args.fsdp_cpu_offload))
        roles[role]["simulated_ranks"] = [p.rank for p in plans]
    if simulation.engine is not None:
        roles["engine"] = role_entry(simulation.engine, False, 0 if args.colocate else engine_receive_bytes(simulation))
        roles["engine"]["rows_per_call"] = simulation.engine_rows
        roles["engine"]["micro_batch"] = simulation.engine_micro_batch
    worst = max(gpu_entries, key=lambda g: g["peak_bytes"])
    return {
        "world_size": len(gpus),
        "gpu": settings.gpu.name,
        "gpu_memory_bytes": settings.gpu.memory_bytes,
        "reserve_bytes": settings.gpu.reserve_bytes,
        "usable_bytes": settings.gpu.usable_bytes,
        "fits": worst["peak_bytes"] <= settings.gpu.usable_bytes,
        "worst_gpu": worst,
        "roles": roles,
        "gpus": gpu_entries,
        "host_pinned_bytes_per_node": host_pinned_per_node(gpus, sleeps),
        "sync_bytes_per_rollout": max((p[0].export_bytes for p in simulation.roles.values()), default=0),
        "flops_per_sample": flops_per_sample(args, simulation),
        "seconds_per_rollout": seconds_per_rollout(args, simulation, settings),
        "assumptions": assumptions(args, simulation, settings),
        "plan_seconds": round(simulation.seconds, 1),
        "suggestions": [],
    }


def flops_per_sample(args: argparse.Namespace, simulation: Simulation) -> dict[str, float]:
    """`forward`: one sample's whole generation (every denoising step with its CFG rows, text encoding, decoding);
    `train`: one sample's share of a training window on every role (forwards, backward, recompute)."""
    forward = simulation.engine_flops / max(1, simulation.engine_rows)
    per_rank_samples = max(1, simulation.window_samples) * args.sp_size  # an sp group shares its samples' work
    train = sum(flops * args.sp_size for flops in simulation.train_flops.values()) / per_rank_samples
    return {"forward": forward, "train": train}


def seconds_per_rollout(args: argparse.Namespace, simulation: Simulation, settings: PlanSettings) -> dict[str, float]:
    """Estimates: FLOPs at --plan-tflops sustained per GPU, the sync's bytes at --plan-interconnect-gbps."""
    per_second = settings.tflops * 1e12
    samples = args.rollout_batch_size * args.n_samples_per_prompt
    algorithm = algorithm_of(args)
    engines = max(1, args.rollout_num_engines)
    engine_share = math.ceil(samples / engines)
    generate = engine_share * simulation.engine_flops / max(1, simulation.engine_rows) / per_second
    windows = args.num_steps_per_rollout
    train = sum(simulation.train_flops.values()) * windows / per_second
    sync_bytes = max((p[0].export_bytes for p in simulation.roles.values()), default=0)
    sync = sync_bytes * 8 / (settings.interconnect_gbps * 1e9)
    return {
        "generate": round(generate if algorithm.uses_engines else 0.0, 3),
        "train": round(train, 3),
        "sync": round(sync, 3),
    }


def assumptions(args: argparse.Namespace, simulation: Simulation, settings: PlanSettings) -> list[str]:
    return [
        "every prompt at its longest (the text encoders' max length)",
        f"{settings.tflops:g} TFLOP/s sustained per GPU, {settings.interconnect_gbps:g} Gbit/s for the weight sync",
        f"{GPUS_PER_NODE} GPUs per node",
        f"reserve per GPU {settings.gpu.reserve_bytes / 2**30:.1f} GiB (CUDA context, NCCL, fragmentation)",
    ]
