"""The run's actors as one thing (ARCHITECTURE §4): the trainer groups, the rollout manager (engines, reward
workers), the shared placement group of --colocate, the evaluator; started together, stopped together."""

from __future__ import annotations

import argparse
import functools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from miles.algorithms import get_algorithm
from miles.arguments.evaluation import eval_enabled
from miles.arguments.records import FlagRecord
from miles.ray.actor_pool import ActorPool, current_pool
from miles.ray.checkpoint_folders import (
    check_data_source_resume,
    check_roles_agree,
    load_folders,
    save_folders,
    write_latest_pointers,
)
from miles.ray.colocation import PhaseMemory
from miles.ray.placement_group import (
    Colocation,
    actor_nodes,
    check_shard_groups,
    create_colocation,
    write_placement,
)
from miles.utils.distributed import engine_cpus, uses_gpu
from miles.utils.failures import run_cleanup
from miles.utils.threads import phase_thread_counts

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunFlags(FlagRecord):
    """The flags the run's groups read themselves; each actor they start gets the whole namespace (its own record)."""

    loss_type: str
    device: str
    debug_rollout_only: bool
    eval_only: bool
    load: str | None
    output_dir: str
    colocate: bool
    async_rollout: bool
    dp_size: int
    sp_size: int
    cpus_per_rank: float
    rollout_num_engines: int
    rollout_cpus_per_engine: float
    cpu_phase_threads: str  # auto | off
    fsdp_shard_size: int | None
    fsdp_strict_shard_groups: bool


def roles_to_start(flags: RunFlags) -> list[str]:
    """The trainer groups this run starts, in training order: none for debug rollouts or for evaluating the
    pipeline as loaded (--eval-only without --load)."""
    nothing_trains = flags.debug_rollout_only or (flags.eval_only and not flags.load)
    return [] if nothing_trains else get_algorithm(flags.loss_type).role_names


def colocation_for(flags: RunFlags) -> Colocation | None:
    """--colocate: the placement group that the trainer groups and the engines share (None without the flag)."""
    if not flags.colocate:
        return None
    return create_colocation(
        flags.dp_size,
        len(roles_to_start(flags)),
        flags.rollout_num_engines,
        use_gpu=uses_gpu(flags),
        cpus_per_rank=flags.cpus_per_rank,
        cpus_per_engine=engine_cpus(flags),
    )


def engines_after_trainers(flags: RunFlags) -> bool:
    """--colocate on GPUs: the engines start loading only once the trainer ranks have sharded, so a GPU never holds
    an engine's whole model beside a rank's loading buffers (on CPU they load meanwhile: start-up is shorter)."""
    return flags.colocate and uses_gpu(flags) and bool(roles_to_start(flags))


def resumes_from_save_folders(args: argparse.Namespace, roles: list[str]) -> bool:
    """Whether every role that saves loads from the folder it saves into (`--load DIR --save DIR`)."""
    saves, loads = save_folders(args, roles), load_folders(args, roles)
    same = [
        (load := loads[role]) and os.path.realpath(load) == os.path.realpath(folder) for role, folder in saves.items()
    ]
    return bool(saves) and all(same)


class RunGroups:
    """`groups` (role -> RayTrainGroup, in training order), `rollout_manager`, and what they share; `phases` moves
    them in and out of device memory (--colocate-sleep; off until `start`)."""

    def __init__(
        self,
        args: argparse.Namespace,
        groups: dict[str, Any],
        rollout_manager: Any,
        *,
        colocation: Colocation | None = None,
        evaluator: Any = None,
        phases: PhaseMemory | None = None,
    ) -> None:
        self.args, self.groups, self.rollout_manager = args, groups, rollout_manager
        self.flags = RunFlags.from_args(args)
        self.colocation, self.evaluator = colocation, evaluator
        self.phases = phases if phases is not None else PhaseMemory(args, {}, None)
        self.saved: int | None = None  # the last rollout whose checkpoint the save folders hold from this run
        self.placement: dict[str, list[dict[str, Any]]] = {}  # where each actor runs, once started (`start`)
        self.start_engines: Callable[[], Any] | None = None  # the rollout manager's start, when it waits (`launch`)

    @classmethod
    def launch(cls, args: argparse.Namespace, pool: ActorPool | None = None) -> RunGroups:
        """Every actor starts at once, none waited for (`start` waits); on a failure those started are stopped.
        `pool` (default: that of an enclosing `reusing_actors` block): idle actors of earlier runs to reuse."""
        # imported here, not at the top: the driver imports this module before ray.init, and these (diffusers,
        # transformers, peft: ~4 s of CPU) load meanwhile on the start-up checks' thread (miles/startup.py)
        from miles.ray.evaluator import Evaluator
        from miles.ray.rollout_manager import RolloutManager
        from miles.ray.train_group import RayTrainGroup

        pool = current_pool() if pool is None else pool
        flags = RunFlags.from_args(args)
        if pool is not None and flags.colocate:  # a colocated run's actors live in its own placement group
            pool.evict_idle()
        launched = cls(args, {}, None, colocation=colocation_for(flags))
        try:
            for role in roles_to_start(flags):
                launched.groups[role] = RayTrainGroup(args, role, colocation=launched.colocation, pool=pool)
            start_engines = functools.partial(
                RolloutManager, args, wait=False, colocation=launched.colocation, pool=pool
            )
            if engines_after_trainers(flags):
                launched.start_engines = start_engines  # `start` calls it once the ranks hold only their shards
            else:
                launched.rollout_manager = start_engines()
            launched.evaluator = Evaluator(args) if eval_enabled(args) else None
        except BaseException:  # a placement group that never came, a broken prompt file
            run_cleanup(launched.shutdown_steps())
            raise
        return launched

    def start(self) -> int:
        """Initialise and resume the trainer groups while the engines and reward workers load, set the per-phase
        thread counts, record where everything runs and give the engines the actor's weights (with --colocate-sleep
        the trainer ranks sleep between the export and the engines' load, as in `to_generate`). Returns the first
        rollout id."""
        args, flags, groups = self.args, self.flags, self.groups
        for group in groups.values():
            group.start_init()
        if self.start_engines is not None:  # colocated on GPUs: the engines' whole models after the ranks' shards
            starts = {role: group.finish_init() for role, group in groups.items()}
            logger.info("trainer ranks hold their shards: the colocated engines load now")
            self.rollout_manager, self.start_engines = self.start_engines(), None
            self.rollout_manager.wait_ready()
        else:  # the engines and reward workers loaded meanwhile
            self.rollout_manager.wait_ready()
            starts = {role: group.finish_init() for role, group in groups.items()}
        manager = self.rollout_manager
        check_roles_agree(args, list(starts), starts)
        self.set_phase_threads()
        start_rollout_id = min(starts.values(), default=0)
        manager.fill_prompt_cache([] if self.evaluator is None else self.evaluator.prompts(), start_rollout_id)
        if flags.load and start_rollout_id > 0:
            check_data_source_resume(flags.load, start_rollout_id, manager.source)
            if resumes_from_save_folders(args, list(groups)):
                self.saved = start_rollout_id - 1
        self.placement = self.record_placement()
        check_shard_groups(flags.fsdp_shard_size, self.placement, flags.fsdp_strict_shard_groups)
        self.phases = PhaseMemory(args, groups, manager.engines, self.placement)
        if groups:  # the version an uninterrupted run holds here: one sync at its start and one per rollout;
            # with --colocate-sleep the ranks sleep once the weights are exported, before the engines load them
            manager.update_weights(groups["actor"], self.phases.start, version=start_rollout_id + 1)
        else:
            self.phases.start()
        return start_rollout_id

    def record_placement(self) -> dict[str, list[dict[str, Any]]]:
        """Where every trainer rank and engine runs (node, IP, GPU ids; a trainer rank's data-parallel group and
        sequence-parallel rank too): `placement.json` in the output folder and a log line per role. Returns it, by
        role (`engines` for the engines)."""
        placement = {role: group.nodes() for role, group in self.groups.items()}
        for role in self.groups:
            for rank, entry in enumerate(placement[role]):
                entry["dp_rank"], entry["sp_rank"] = divmod(rank, self.flags.sp_size)
        if self.rollout_manager.engines is not None:
            placement["engines"] = actor_nodes(self.rollout_manager.engines.engines)
        if self.rollout_manager.rewards is not None and self.rollout_manager.rewards.workers:
            placement["reward_workers"] = actor_nodes(self.rollout_manager.rewards.workers)
        write_placement(self.flags.output_dir, placement)
        return placement

    def set_phase_threads(self) -> None:
        """Colocated phases on CPU (`--cpu-phase-threads auto`): engines and trainer ranks that share a node use its
        cores for their own phase (generate / train) and their base count otherwise (`miles.utils.threads`)."""
        flags, engines = self.flags, self.rollout_manager.engines
        if flags.cpu_phase_threads == "off" or uses_gpu(flags) or engines is None or not self.groups:
            return
        if flags.async_rollout:  # generation and training overlap: no phase has the node to itself
            logger.info("phase threads off: --async-rollout runs generation and training at once")
            return
        groups = self.groups.values()
        engine_counts, rank_counts = phase_thread_counts(engines.node_infos(), [g.node_infos() for g in groups])
        engines.set_generate_threads(engine_counts)
        for group, counts in zip(groups, rank_counts):
            group.set_train_threads(counts)
        logger.info(
            "phase threads: engines generate with %s, trainer ranks train with %s torch threads",
            engine_counts,
            dict(zip(self.groups, rank_counts)),
        )

    def save(self, rollout_id: int) -> float | None:
        """Every role with a save folder saves rollout `rollout_id` (with the data source's state), then the latest
        pointers move; seconds taken, or None when no role saves."""
        folders = save_folders(self.args, list(self.groups))  # role -> --save / --critic-save
        if not folders:
            return None
        started = time.perf_counter()
        extra = {"data_source": self.rollout_manager.source.state_dict(rollout_id + 1)}
        for role in folders:
            self.groups[role].save(rollout_id, extra)
        write_latest_pointers(folders, rollout_id)
        self.saved = rollout_id
        return time.perf_counter() - started

    def save_on_stop(self, rollout_id: int) -> list[str]:
        """A stop signal's save: rollout `rollout_id`, the last completed (its trained state is what the ranks hold),
        unless this run saved it already (or resumed from it in its own save folders). Its iteration folders ([] when
        no role saves or no rollout completed)."""
        folders = save_folders(self.args, list(self.groups))
        if not folders or rollout_id < 0:
            return []
        if self.saved != rollout_id:  # not the folders' pointer: it may name another run's save of that rollout
            self.phases.to_train(rollout_id)  # with --colocate-sleep the ranks sleep after a weight sync
            self.save(rollout_id)
        return [os.path.join(folder, f"iter_{rollout_id:07d}") for folder in dict.fromkeys(folders.values())]

    def update_weights(self, rollout_id: int) -> float:
        """The actor's weights to the engines after rollout `rollout_id` trained; with --colocate-sleep the trainer
        ranks sleep and the engines wake once the weights are exported. Seconds taken."""
        to_generate = functools.partial(self.phases.to_generate, rollout_id)
        seconds: float = self.rollout_manager.update_weights(self.groups["actor"], to_generate, rollout_id=rollout_id)
        return seconds

    def pop_metrics(self) -> list[dict[str, Any]]:
        """The trainer windows' records since the last call, group by group in training order."""
        return [record for group in self.groups.values() for record in group.pop_metrics()]

    def evaluate(self, rollout_id: int) -> dict[str, float]:
        """The held-out eval on the engines, recorded at `rollout_id` (0: the baseline before any update)."""
        metrics: dict[str, float] = self.evaluator.evaluate(self.rollout_manager.engines, rollout_id)
        return metrics

    def save_hf(self, out_dir: str, rollout_id: int | None = None) -> None:
        """The actor as a diffusers pipeline folder (or LoRA adapter); its ranks hold the device for the gather."""
        self.phases.to_train(rollout_id)
        self.groups["actor"].save_hf(out_dir)
        logger.info("wrote a diffusers pipeline folder to %s", out_dir)

    def shutdown_steps(self) -> list[tuple[str, Callable[[], Any]]]:
        """The cleanup steps of everything here, in order (`failures.run_cleanup` runs them all)."""
        steps = [(f"shutdown of the {role} group", group.shutdown) for role, group in self.groups.items()]
        if self.rollout_manager is not None:
            steps.append(("shutdown of the rollout manager", self.rollout_manager.shutdown))
        if self.colocation is not None:
            steps.append(("removing the shared placement group", self.colocation.remove))
        return steps
