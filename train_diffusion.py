"""The miles driver (ARCHITECTURE §4): parse flags, start the groups, loop generate -> train -> save."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence

COMMAND_STARTED = time.perf_counter()  # as a script: the command's start, less the interpreter's own (~0.05 s)

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

logger = logging.getLogger("miles.driver")


def training_order(args: argparse.Namespace) -> list[str]:
    """Roles in the order they train each rollout, from the loss hub's entries (a critic trains before the actor
    it scores for); each group's boxes feed the next."""
    from miles.backends.fsdp_utils.loss_hub import LOSS_HOOKS

    return ["critic", "actor"] if (args.loss_type, "critic") in LOSS_HOOKS else ["actor"]


def actor_shares(args: argparse.Namespace, per_rank: float, per_engine: float) -> tuple[float, float]:
    """(trainer ranks' total, rollout engines' total) of one resource, given each actor's share of it."""
    trainers = args.dp_size * per_rank * len(training_order(args))
    engines = 0.0 if args.loss_type == "sft_loss" else args.rollout_num_engines * per_engine
    return trainers, engines


def local_ray_cpus(args: argparse.Namespace) -> int:
    """Logical CPUs for a Ray cluster this driver starts: the machine's, or enough for every actor's share.

    Shares are scheduling labels, not pinned cores: a dmd2 run (actor and critic groups, an engine) asks for more
    than a 2-core laptop has, and Ray would wait forever for CPUs that never come.
    """
    import math

    from miles.ray.reward_workers import REWARD_WORKER_CPUS
    from miles.utils.distributed import engine_cpus, uses_gpu

    gpu = uses_gpu(args)
    trainers, engines = actor_shares(args, 0.0 if gpu else args.cpus_per_rank, engine_cpus(args))
    workers = 0.0 if args.loss_type == "sft_loss" else REWARD_WORKER_CPUS * args.rm_num_workers
    return max(os.cpu_count() or 1, math.ceil(trainers + engines + workers))


def check_gpus_fit(args: argparse.Namespace, cluster_gpus: float) -> None:
    """Fail at once, naming the flags, when the trainer ranks and engines ask for more GPUs than the cluster has
    (otherwise a placement group waits for GPUs that never come)."""
    from miles.utils.distributed import uses_gpu

    if not uses_gpu(args):
        return
    roles = training_order(args)
    if args.colocate:
        if args.dp_size > cluster_gpus:
            raise ValueError(
                f"--colocate puts rank i of every group and its engines on GPU i: --dp-size {args.dp_size} needs "
                f"{args.dp_size} GPUs but the Ray cluster has {cluster_gpus:g}: lower --dp-size"
            )
        return
    if args.dp_size > 1 and args.gpus_per_rank < 1:
        raise ValueError(
            f"--gpus-per-rank {args.gpus_per_rank:g} with --dp-size {args.dp_size}: Ray packs fractional shares onto "
            "as few GPUs as it can, so ranks of one group would share a GPU, which NCCL refuses; to share GPUs "
            "between trainer ranks and rollout engines use --colocate (whole GPUs, one rank of each group per GPU)"
        )
    trainers, engines = actor_shares(args, args.gpus_per_rank, args.rollout_gpus_per_engine)
    if trainers + engines <= cluster_gpus + 1e-9:
        return
    if args.dp_size > cluster_gpus:
        hint = f"lower --dp-size to at most {int(cluster_gpus)} (ranks of one group need distinct GPUs under nccl)"
    else:
        hint = "share them with --colocate (rank i of every group and engines i, i + dp-size, ... on GPU i)"
    raise ValueError(
        f"the run needs {trainers + engines:g} GPUs ({len(roles)} group(s) x --dp-size {args.dp_size} x "
        f"--gpus-per-rank {args.gpus_per_rank:g}, plus {engines:g} for the rollout engines) but the Ray cluster has "
        f"{cluster_gpus:g}: {hint}"
    )


def setup_logging(args: argparse.Namespace) -> None:
    os.makedirs(args.output_dir, exist_ok=True)
    from miles.utils.console import TqdmHandler

    handlers = [TqdmHandler(sys.stderr), logging.FileHandler(os.path.join(args.output_dir, "train.log"))]
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        handlers=handlers,
        force=True,
    )


def is_due(rollout_id: int, interval: int | None, last: int) -> bool:
    return rollout_id == last or (interval is not None and (rollout_id + 1) % interval == 0)


def check_startup(args: argparse.Namespace) -> None:
    """Before Ray and any actor: every path flag loads with the right signature, the family accepts its options
    and the run's flags, the loss type has its entries."""
    from miles.backends.fsdp_utils.loss_hub import get_loss_hooks
    from miles.models.base import family_options, get_train_pipeline_config, load_family_class
    from miles.rollout.rollout_hub import check_async_rollout, get_rollout_spec
    from miles.utils.eval_arguments import eval_enabled
    from miles.utils.hook_paths import load_path_flags

    load_path_flags(args)
    if args.train_pipeline_config_path:
        load_family_class(args.train_pipeline_config_path)
    # the family's options (--num-frames, ...) against the folder, and its own checks of the run's flags
    family = get_train_pipeline_config(args.hf_checkpoint, args.model_family, **family_options(args))
    family.check_run_args(args)
    if eval_enabled(args) and not args.eval_function_path and len(family.latent_shape(args.resolution)) != 3:
        raise ValueError(
            f"the built-in shapes eval scores images, and {family.name} makes video: pass --eval-interval 0 or your "
            "own --eval-function-path"
        )
    for role in training_order(args):
        get_loss_hooks(args, role)
    if not args.train_only:
        get_rollout_spec(args.loss_type)
    check_async_rollout(args)


def ray_init_settings(args: argparse.Namespace) -> dict | None:
    """`ray.init` keywords of this run's cluster (sized here, which imports torch and the loss hub), or None when
    Ray is up already (tests, tools). Without --ray-address: a local cluster sized for every actor's share, always
    one of this run's own, never one that another run on the machine started."""
    import ray

    from miles.utils.console import ray_init_kwargs

    if ray.is_initialized():
        return None
    if args.ray_address:
        return {"address": args.ray_address, **ray_init_kwargs(local=False)}
    return {"address": "local", "num_cpus": local_ray_cpus(args), **ray_init_kwargs(local=True)}


def start_ray(settings: dict | None) -> bool:
    """Start or join the cluster of `ray_init_settings`; True when this driver started it. Call it from the main
    thread: Ray's processes end with the thread that started them."""
    import ray

    if settings is None:
        return False
    ray.init(include_dashboard=False, log_to_driver=True, **settings)
    return True


def startup_checks(args: argparse.Namespace) -> float:
    """Built-in checkpoint names resolved, then every check that needs no actor: flags, paths, families, prompt
    files (FILE:LINE errors), the roles' resume points. `run` does them on a worker thread while Ray starts; they
    also import the modules the driver needs next. Returns when they ended (`time.perf_counter`)."""
    from miles.models.builtin import resolve_checkpoint
    from miles.ray.checkpoint_folders import check_roles_agree
    from miles.rollout.input_files import check_input_files

    for dest in ("hf_checkpoint", "teacher_load", "critic_checkpoint"):  # builtin:NAME -> the packaged folder
        setattr(args, dest, resolve_checkpoint(getattr(args, dest, None)))
    check_startup(args)
    check_input_files(args)
    check_roles_agree(args, training_order(args))
    import miles.ray.rollout_manager  # noqa: F401  (the imports `run` needs next, done here meanwhile too)
    import miles.ray.train_group  # noqa: F401

    return time.perf_counter()


def trained_roles(args: argparse.Namespace) -> list[str]:
    """The roles this run trains: none for debug rollouts or evaluating the pipeline as loaded."""
    return [] if args.debug_rollout_only or (args.eval_only and not args.load) else training_order(args)


def create_colocation(args: argparse.Namespace):
    """--colocate: the placement group that the trainer groups and the engines share (None without the flag)."""
    from miles.ray.placement_group import create_colocation as create
    from miles.utils.distributed import engine_cpus, uses_gpu

    if not args.colocate:
        return None
    return create(
        args.dp_size,
        len(trained_roles(args)),
        args.rollout_num_engines,
        use_gpu=uses_gpu(args),
        cpus_per_rank=args.cpus_per_rank,
        cpus_per_engine=engine_cpus(args),
    )


def launch_groups(args: argparse.Namespace, colocation=None) -> dict:
    """The trainer groups' actors, started without waiting for them to load (`start_groups` waits); with
    `colocation` (--colocate) in its shared placement group."""
    from miles.ray.train_group import RayTrainGroup
    from miles.utils.failures import run_cleanup

    groups: dict = {}
    try:
        for role in trained_roles(args):
            groups[role] = RayTrainGroup(args, role, colocation=colocation)
    except BaseException:  # a placement group that never came: end the groups already started
        run_cleanup([(f"shutdown of the {role} group", group.shutdown) for role, group in groups.items()])
        raise
    return groups


def start_groups(args: argparse.Namespace, groups: dict, rollout_manager) -> int:
    """Initialise and resume the launched trainer groups while the engines and reward workers load (everything
    starts at once), set the per-phase thread counts, and give the engines the actor's weights. Returns the first
    rollout id. On failure the groups are shut down here (the caller never holds them)."""
    from miles.ray.checkpoint_folders import check_roles_agree
    from miles.utils.failures import run_cleanup

    try:
        for group in groups.values():
            group.start_init()
        rollout_manager.wait_ready()
        starts = {role: group.finish_init() for role, group in groups.items()}
        check_roles_agree(args, list(starts), starts)
        set_phase_threads(args, rollout_manager, groups)
    except BaseException:  # a failed load, a dead rank
        run_cleanup([(f"shutdown of the {role} group", group.shutdown) for role, group in groups.items()])
        raise
    start_rollout_id = min(starts.values(), default=0)
    if args.load and start_rollout_id > 0:
        check_data_source_resume(args.load, start_rollout_id, rollout_manager.source)
    if groups:
        rollout_manager.update_weights(groups["actor"])
    return start_rollout_id


def record_placement(args: argparse.Namespace, groups: dict, rollout_manager) -> dict:
    """Where every trainer rank and engine runs (node, IP, GPU ids): `placement.json` in the output folder and a log
    line per role. Returns it, by role (`engines` for the engines)."""
    from miles.ray.placement_group import actor_nodes, write_placement

    placement = {role: actor_nodes(group.actors) for role, group in groups.items()}
    if rollout_manager.engines is not None:
        placement["engines"] = actor_nodes(rollout_manager.engines.engines)
    write_placement(args.output_dir, placement)
    return placement


def set_phase_threads(args: argparse.Namespace, rollout_manager, groups: dict) -> None:
    """Colocated phases on CPU (`--cpu-phase-threads auto`): engines and trainer ranks that share a node use its
    cores for their own phase (generate / train) and their base count otherwise (`miles.utils.threads`)."""
    from miles.utils.distributed import uses_gpu
    from miles.utils.threads import phase_thread_counts

    engines = rollout_manager.engines
    if args.cpu_phase_threads == "off" or uses_gpu(args) or engines is None or not groups:
        return
    if args.async_rollout:  # generation and training overlap: no phase has the node to itself
        logger.info("phase threads off: --async-rollout runs generation and training at once")
        return
    engine_counts, rank_counts = phase_thread_counts(
        engines.node_infos(), [group.node_infos() for group in groups.values()]
    )
    engines.set_generate_threads(engine_counts)
    for group, counts in zip(groups.values(), rank_counts):
        group.set_train_threads(counts)
    logger.info(
        "phase threads: engines generate with %s, trainer ranks train with %s torch threads",
        engine_counts,
        {role: counts for role, counts in zip(groups, rank_counts)},
    )


class Generations:
    """Each rollout's batch with its rollout metrics and generation seconds: generated when asked for, or with
    --async-rollout one rollout ahead on a worker thread, so that batch k+1 generates while batch k trains.

    Ahead, batch k+1 is asked of the engines right after batch k is in, before k trains: an engine runs its calls
    in order, so k+1 samples with the weights the engines hold then (those before update k), and the sync after
    update k reaches them after it. Staleness is at most one update; `run_rollout` records and checks it.
    """

    def __init__(self, args: argparse.Namespace, rollout_manager) -> None:
        self.args, self.rollout_manager = args, rollout_manager
        self.ahead: dict = {}  # rollout id -> future of its generation
        self.executor = None
        if getattr(args, "async_rollout", False):
            from concurrent.futures import ThreadPoolExecutor

            self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="miles-rollout")

    def _generate(self, rollout_id: int) -> tuple[list, dict, float]:
        started = time.perf_counter()
        data = self.rollout_manager.generate(rollout_id)
        return data, self.rollout_manager.metrics(rollout_id), time.perf_counter() - started

    def get(self, rollout_id: int) -> tuple[list, dict, float]:
        """(one box per dp rank, the rollout's metrics, seconds its generation took); ahead, starts the next one."""
        if self.executor is None:
            return self._generate(rollout_id)
        future = self.ahead.pop(rollout_id, None) or self.executor.submit(self._generate, rollout_id)
        result = future.result()
        if rollout_id + 1 < self.args.num_rollout:
            self.ahead[rollout_id + 1] = self.executor.submit(self._generate, rollout_id + 1)
        return result

    def close(self) -> None:
        """Drop a generation not yet started; one under way ends with the engines (shut down after this)."""
        if self.executor is not None:
            self.executor.shutdown(wait=False, cancel_futures=True)
        self.ahead.clear()


def run_rollout(
    args: argparse.Namespace,
    rollout_id: int,
    groups: dict,
    rollout_manager,
    evaluator,
    writer,
    started: float | None = None,
    generations: Generations | None = None,
    phases=None,
) -> dict:
    """One rollout: generate, train each group in order, sync weights, save and eval when due; returns its record
    (the trainer windows' records are logged as they come). `started`: the command's start on the perf_counter
    clock, given for the run's first rollout only: its record then holds `perf/startup_s`. `generations`: where
    the batch comes from (default: generated now). `phases`: the run's `PhaseMemory` (--colocate-sleep), which
    puts the engines to sleep for training and the trainer ranks after the weights are exported."""
    from miles.ray.checkpoint_folders import save_folders, write_latest_pointers
    from miles.utils.failures import set_current_rollout

    set_current_rollout(rollout_id)  # named by failures of engines and reward workers
    last = args.num_rollout - 1
    t0 = time.perf_counter()
    startup_s = None if started is None else t0 - started
    data, rollout_metrics, generate_s = (generations or Generations(args, rollout_manager)).get(rollout_id)
    t1 = time.perf_counter()
    async_metrics = staleness_metrics(args, rollout_manager, rollout_id, rollout_metrics, t1 - t0)
    peer = None
    if phases is not None and not args.debug_rollout_only:
        phases.to_train()
    if not args.debug_rollout_only:
        for role in training_order(args):
            peer = groups[role].train(rollout_id, data, peer)
    t2 = time.perf_counter()
    save_s = None
    folders = save_folders(args, list(groups))  # role -> --save / --critic-save
    if folders and is_due(rollout_id, args.save_interval, last):  # saved while the ranks are awake, before the sync
        extra = {"data_source": rollout_manager.source.state_dict(rollout_id + 1)}
        for role in folders:
            groups[role].save(rollout_id, extra)
        write_latest_pointers(folders, rollout_id)
        save_s = time.perf_counter() - t2
    weight_sync_s = 0.0
    if not args.debug_rollout_only:
        to_generate = phases.to_generate if phases is not None else None
        weight_sync_s = rollout_manager.update_weights(groups["actor"], before_load=to_generate)
    records = [m for group in groups.values() for m in group.pop_metrics()]
    for record in records:
        writer.log(record)
    rollout_record = {
        "rollout_id": rollout_id,
        "step": records[-1]["step"] if records else None,
        "perf/generate_total_s": generate_s,
        "perf/train_s": t2 - t1,
        "perf/weight_sync_s": weight_sync_s,
        **rollout_metrics,
        **async_metrics,
        **({"perf/startup_s": startup_s} if startup_s is not None else {}),
        **({"perf/save_s": save_s} if save_s is not None else {}),
        **({"perf/colocate_swap_s": phases.pop_seconds()} if phases is not None and phases.enabled else {}),
    }
    if evaluator is not None and is_due(rollout_id, args.eval_interval, last):
        rollout_record.update(evaluator.evaluate(rollout_manager.engines, rollout_id + 1))
    writer.log(rollout_record)
    rollout_record["_actor_losses"] = [r["train/loss"] for r in records if "train/loss" in r and r["role"] == "actor"]
    rollout_record["_train_records"] = records
    return rollout_record


def staleness_metrics(args, rollout_manager, rollout_id: int, rollout_metrics: dict, wait_s: float) -> dict:
    """--async-rollout: the trainer's weights version (the last one synced: its weights now) against the batch's,
    and the seconds the driver waited for the batch; a batch more than one update behind is an error."""
    if not getattr(args, "async_rollout", False) or "rollout/weights_version" not in rollout_metrics:
        return {}
    trainer = rollout_manager.weights_version
    staleness = trainer - rollout_metrics["rollout/weights_version"]
    if not 0 <= staleness <= 1:
        raise RuntimeError(
            f"rollout {rollout_id} was generated with weights version {rollout_metrics['rollout/weights_version']} "
            f"but the trainer holds version {trainer}: --async-rollout allows one update of staleness"
        )
    return {"rollout/staleness": staleness, "rollout/trainer_weights_version": trainer, "perf/generate_wait_s": wait_s}


def train_rollouts(
    args, groups, rollout_manager, evaluator, writer, start_rollout_id: int, summary: dict, started: float, phases=None
) -> None:
    """The outer loop (ARCHITECTURE §4) with a progress bar; `started` as in `run`, `phases` as in `run_rollout`."""
    from miles.utils.console import ProgressLine, progress_bar

    bar, progress = progress_bar(range(start_rollout_id, args.num_rollout), args), ProgressLine(args.loss_type)
    generations = Generations(args, rollout_manager)
    try:
        for rollout_id in bar:
            first = rollout_id == start_rollout_id
            if first:
                logger.info("start-up: %.1fs from the command to the first rollout", time.perf_counter() - started)
            record = run_rollout(
                args,
                rollout_id,
                groups,
                rollout_manager,
                evaluator,
                writer,
                started=started if first else None,
                generations=generations,
                phases=phases,
            )
            summary["losses"] += record.pop("_actor_losses")
            train_records = record.pop("_train_records")
            summary.setdefault("rollouts", []).append(record)
            bar.set_postfix(progress.update([*train_records, record]))
    finally:
        generations.close()


def run(
    args: argparse.Namespace,
    before_shutdown: Callable[[dict], None] | None = None,
    *,
    started: float | None = None,
) -> dict:
    """Run the whole job; returns a summary (actor losses, wall time).

    `before_shutdown(groups)` lets tools and tests inspect the live groups after the last rollout. `started`: when
    the command started, on the `time.perf_counter` clock (`main` passes the process's start); default now. The
    first rollout's record holds `perf/startup_s`, the seconds from then to its start.
    """
    from concurrent.futures import ThreadPoolExecutor

    import ray

    from miles.plot import plot_run
    from miles.ray.checkpoint_folders import lock_save_folders
    from miles.utils import import_gc
    from miles.utils.console import summary_line
    from miles.utils.eval_arguments import eval_enabled
    from miles.utils.failures import run_cleanup, set_current_rollout
    from miles.utils.fsdp_arguments import resolve_cluster_device
    from miles.utils.tracking import open_tracking, read_metrics

    started = time.perf_counter() if started is None else started
    # the start-up's imports (torch, diffusers, the families) without the garbage collector (miles.utils.import_gc)
    with import_gc.paused():
        settings = ray_init_settings(args)
        locks = lock_save_folders(args)  # held until the end of the run (and released if the process dies)
        sized = time.perf_counter()
        # the checks (and the imports they need) on a thread while Ray starts here: errors still come before any actor
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="miles-checks") as pool:
            checks = pool.submit(startup_checks, args)
            try:
                own_ray = start_ray(settings)
            except BaseException:
                locks.release()
                failed_check = checks.exception()  # waits for the checks: a failed one is the error to report
                if failed_check is not None:
                    raise failed_check  # noqa: B904 - Ray's error stays attached as its context
                raise
            ray_ready = time.perf_counter()
    writer = colocation = None
    groups: dict = {}
    rollout_manager = None
    summary: dict = {"losses": []}
    try:
        checked = checks.result()
        writer = open_tracking(args)
        from miles.ray.colocation import PhaseMemory
        from miles.ray.evaluator import Evaluator
        from miles.ray.rollout_manager import RolloutManager

        cluster_gpus = ray.cluster_resources().get("GPU", 0.0)
        if args.ray_address is not None:  # --device / forward dtype `auto` from the cluster's GPUs, not this node's
            resolve_cluster_device(args, cluster_gpus)
        check_gpus_fit(args, cluster_gpus)
        colocation = create_colocation(args)
        groups = launch_groups(args, colocation)  # every actor starts at once; start_groups waits for them all
        rollout_manager = RolloutManager(args, wait=False, colocation=colocation)
        start_rollout_id = start_groups(args, groups, rollout_manager)
        placement = record_placement(args, groups, rollout_manager)
        logger.info(
            "start-up phases: sizing the cluster %.1fs, then checks %.1fs alongside ray.init %.1fs, actors (started "
            "together) %.1fs",
            sized - started,
            checked - sized,
            ray_ready - sized,
            time.perf_counter() - max(checked, ray_ready),
        )
        phases = PhaseMemory(args, groups, rollout_manager.engines, placement)  # --colocate-sleep
        phases.start()
        evaluator = Evaluator(args) if eval_enabled(args) else None
        if evaluator is not None:  # the baseline, before any update of this run
            baseline = evaluator.evaluate(rollout_manager.engines, start_rollout_id)
            writer.log({"rollout_id": start_rollout_id, "step": 0, **baseline})
        if args.eval_only:
            return summary
        train_rollouts(args, groups, rollout_manager, evaluator, writer, start_rollout_id, summary, started, phases)
        if args.save_hf and groups:
            phases.to_train()  # the gather needs the ranks' weights on the device, not the engines'
            groups["actor"].save_hf(args.save_hf)
            logger.info("wrote a diffusers pipeline folder to %s", args.save_hf)
        if before_shutdown is not None:
            before_shutdown(groups)
    finally:  # every step runs; a failing one does not hide the error that stopped the run
        steps = [(f"shutdown of the {role} group", group.shutdown) for role, group in groups.items()]
        if rollout_manager is not None:
            steps.append(("shutdown of the rollout manager", rollout_manager.shutdown))
        if colocation is not None:
            steps.append(("removing the shared placement group", colocation.remove))
        if writer is not None:
            steps.append(("closing metrics.jsonl", writer.close))
        if own_ray:
            steps.append(("ray.shutdown", ray.shutdown))
        steps.append(("releasing the save-folder locks", locks.release))
        run_cleanup(steps)
        set_current_rollout(None)
    summary["wall_s"] = time.perf_counter() - started
    summary["plot"] = plot_run(args.output_dir, args.loss_type)
    logger.info(summary_line(args, read_metrics(writer.path), summary["wall_s"], summary["plot"]))
    return summary


def check_data_source_resume(load_dir: str, start_rollout_id: int, source) -> None:
    """Warn when a resumed run would not continue the saved prompt stream (other data, seed or batch size)."""
    from miles.backends.fsdp_utils.checkpoint import read_extra

    extra = read_extra(load_dir, start_rollout_id - 1, "actor") or {}
    state = extra.get("data_source")
    if state is None:
        logger.warning(
            "%s holds no data-source state: cannot confirm that rollout %d continues the saved prompt stream",
            load_dir,
            start_rollout_id,
        )
        return
    mismatches = source.resume_mismatches(state, start_rollout_id)
    if mismatches:
        logger.warning(
            "resuming from %s with different prompt data or settings; the prompt stream will not continue the "
            "saved one (%s)",
            load_dir,
            "; ".join(mismatches),
        )
    else:
        logger.info("prompt stream resumes at rollout %d (epoch %d)", start_rollout_id, state["epoch"])


def main(argv: Sequence[str] | None = None, started: float | None = None) -> int:
    """`started`: the command's start on the `time.perf_counter` clock (default now); see `run`."""
    from miles.utils.arguments import parse_args

    started = time.perf_counter() if started is None else started
    args = parse_args(argv)
    setup_logging(args)
    run(args, started=started)
    return 0


if __name__ == "__main__":
    sys.exit(main(started=COMMAND_STARTED))
