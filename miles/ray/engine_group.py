"""RolloutEngineGroup: N Ray actors of `DiffusionEngine` (`EngineActor`) behind one `generate` / `update_weights`.

A batch is split into contiguous chunks (seeds and initial seeds travel with their prompts) and joined back in order.
Every wait has a deadline (`EngineTimeouts`); while it waits the group reads each engine's progress reports
(`miles.ray.engine_wait`), which restart the deadline of a call that is still working.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from miles.utils import import_gc

# ruff: noqa: E402 - the imports below come after the collector's pause
# a Ray worker imports this module to start an engine: its imports run without the collector until
# EngineActor.__init__ resumes it (docs/user-guide/performance.md, "Imports without the garbage collector")
import_gc.pause_in_ray_worker()

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from miles.arguments.engine import EngineTimeouts
from miles.ray.actor_pool import ActorPool, ReusableActor
from miles.ray.engine_wait import Allowance, EngineWait
from miles.ray.placement_group import Colocation
from miles.rollout.engine import DiffusionEngine
from miles.rollout.engine_api import GenerateRequest, GenerateResult
from miles.rollout.micro_batches import AUTO, EngineProgress
from miles.rollout.prompt_cache import PromptCacheConfig
from miles.utils.failures import ACTOR_GONE, EngineError, start_failure, where
from miles.utils.heap import keep_freed_memory
from miles.utils.misc import split_contiguous
from miles.utils.stop_signals import defer_first_sigterm
from miles.utils.weight_checksum import TensorChecksum, WeightSyncError
from miles.weight_sync.protocol import SyncPlan
from miles.weight_sync.transports import TransportSpec

logger = logging.getLogger(__name__)


def engine_options(
    index: int, num_cpus: float, num_gpus: float, colocation: Colocation | None = None
) -> dict[str, Any]:
    """Ray options of engine `index`: its own shares, or (--colocate) a place in bundle index % dp-size of the
    shared placement group with that bundle's GPU share."""
    if colocation is None:
        return {"num_cpus": num_cpus, "num_gpus": num_gpus}
    strategy = PlacementGroupSchedulingStrategy(
        colocation.placement_group, placement_group_bundle_index=colocation.bundle_of_engine(index)
    )
    gpus = colocation.gpu_share if num_gpus > 0 else 0
    return {"num_cpus": num_cpus, "num_gpus": gpus, "scheduling_strategy": strategy}


class EngineActor(DiffusionEngine, ReusableActor):
    """A `DiffusionEngine` in its own Ray worker process, which on CPU keeps the memory each generation frees for the
    next one (`miles.utils.heap`) before it loads the pipeline. An `ActorPool` may hand its process to the next run
    (`release`, then `reuse` with that run's pipeline)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        import_gc.resume()  # this module's imports are done (the pause at its top)
        defer_first_sigterm()  # a scheduler's signal to the whole job: live on while the driver saves
        self._remember_process_baseline()
        if torch.device(kwargs.get("device", "cpu")).type == "cpu":
            keep_freed_memory()
        super().__init__(*args, **kwargs)

    # the same method, wrapped as Ray's actors call it (`.remote()`)
    @ray.method(concurrency_group="progress")
    def progress(self) -> EngineProgress:  # type: ignore[override]
        """Answered on its own thread while `generate` runs (every other call waits its turn, in order)."""
        return super().progress()


# the Ray options every engine actor class takes: `progress` runs beside the call in progress
ENGINE_ACTOR_OPTIONS: dict[str, Any] = {"concurrency_groups": {"progress": 1}}


class RolloutEngineGroup:
    """`num_engines` engine actors; each asks for `num_gpus_per_engine` GPUs (then runs on cuda) or, without
    GPUs, `num_cpus_per_engine` (fractional) CPUs. Every wait is bounded by `timeouts`: start-up by its own
    deadline, generate by `--rollout-timeout` (restarted by each progress report, or one total), weight syncs,
    sleeps and wakes by the sync deadline (restarted by the reports of a generation the engine finishes first)."""

    def __init__(
        self,
        hf_checkpoint: str,
        *,
        num_engines: int = 1,
        model_family: str = "auto",
        num_cpus_per_engine: float = 1.0,
        num_gpus_per_engine: float = 0.0,
        forward_dtype: torch.dtype = torch.float32,
        lora_config: dict[str, Any] | None = None,
        family_options: dict[str, Any] | None = None,
        compile_mode: str = "off",
        prompt_cache: PromptCacheConfig | None = None,
        micro_batch_size: int | str = AUTO,
        timeouts: EngineTimeouts = EngineTimeouts(),
        wait: bool = True,
        colocation: Colocation | None = None,
        pool: ActorPool | None = None,
        engine_class: type = EngineActor,
    ) -> None:
        """Start the engine actors; with `wait=False` they load in the background until `wait_ready` (so the
        driver can start trainer ranks meanwhile). With `colocation` (--colocate) engine i runs in bundle
        i % dp-size of the shared placement group, next to the trainer ranks of that bundle. With `pool` (not with
        `colocation`), idle engines of an earlier run with the same resource shares load this pipeline instead of
        new processes, and go back to it at `shutdown`. `engine_class`: the actor class (an `EngineActor`)."""
        if num_engines < 1:
            raise ValueError(f"num_engines must be >= 1, got {num_engines}")
        self.timeouts, self.failed = timeouts, False
        self.on_progress: Callable[[str], None] | None = None  # the driver's display of generate progress
        self.poll_s, self.log_every_s = 1.0, 30.0  # how often a wait reads the engines' progress, and logs it
        device = "cuda" if num_gpus_per_engine > 0 else "cpu"
        self.pool = pool if colocation is None else None
        self.pool_key = ("engine", num_cpus_per_engine, num_gpus_per_engine)
        init_kwargs = {
            "model_family": model_family,
            "device": device,
            "forward_dtype": forward_dtype,
            "lora_config": lora_config,
            "family_options": family_options,
            "compile_mode": compile_mode,
            "prompt_cache": prompt_cache,
            "micro_batch_size": micro_batch_size,
        }
        remote_cls: Any = ray.remote(**ENGINE_ACTOR_OPTIONS)(engine_class)  # a Ray actor class
        self.engines: list[Any] = []  # Ray actor handles
        self._starting: dict[int, Any] | None = {}  # engine index -> its start-up answer, until `wait_ready`
        for index in range(num_engines):
            engine = self.pool.take(self.pool_key) if self.pool is not None else None
            if engine is not None:  # its answer to `reuse` is its health once the pipeline is loaded
                self._starting[index] = engine.reuse.remote(hf_checkpoint, **init_kwargs)
            else:
                if self.pool is not None:  # idle pooled actors hold resources: end the oldest until this one fits
                    self.pool.make_room({"CPU": num_cpus_per_engine, "GPU": num_gpus_per_engine})
                options = engine_options(index, num_cpus_per_engine, num_gpus_per_engine, colocation)
                engine = remote_cls.options(**options).remote(hf_checkpoint, **init_kwargs)
                self._starting[index] = engine.health.remote()
            self.engines.append(engine)
        self.device = device
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Wait (within the timeout) until every engine has loaded its pipeline; a no-op once they have."""
        if self._starting is None:
            return
        self._gather(self._starting, "starting", Allowance.fixed(self.timeouts.startup_s, "--rollout-startup-timeout"))
        self._starting = None
        logger.info("%d rollout engine(s) ready on %s", self.num_engines, self.device)

    def node_infos(self) -> list[tuple[str, int]]:
        """(Ray node id, cores) of each engine."""
        results = self._gather({i: e.node_info.remote() for i, e in enumerate(self.engines)}, "node_info")
        return [results[i] for i in range(self.num_engines)]

    def set_generate_threads(self, counts: list[int | None]) -> None:
        """Each engine's torch thread count while it generates (None: its base count)."""
        refs = {i: e.set_generate_threads.remote(count) for i, (e, count) in enumerate(zip(self.engines, counts))}
        self._gather(refs, "set_generate_threads")

    def sleep(self, discard_weights: bool = False, rollout_id: int | None = None) -> list[dict[str, float]]:
        """Every engine moves its networks to host memory; with `discard_weights` the trained weights are freed
        without a copy (the next `update_weights` replaces them). `rollout_id`, as in every call here: the rollout
        a failure names."""
        refs = {i: e.sleep.remote(discard_weights) for i, e in enumerate(self.engines)}
        results = self._gather(refs, where("sleep", rollout_id))
        return [results[i] for i in range(self.num_engines)]

    def wake(self, rollout_id: int | None = None) -> list[dict[str, float]]:
        """Every engine brings back what `sleep` moved."""
        results = self._gather({i: e.wake.remote() for i, e in enumerate(self.engines)}, where("wake", rollout_id))
        return [results[i] for i in range(self.num_engines)]

    @property
    def num_engines(self) -> int:
        return len(self.engines)

    def generate(self, request: GenerateRequest, rollout_id: int | None = None) -> GenerateResult:
        """The whole batch, generated in contiguous chunks, one per engine, joined in order."""
        return self.collect(self.submit(request, rollout_id))

    def submit(
        self, request: GenerateRequest, rollout_id: int | None = None
    ) -> tuple[dict[int, Any], str, dict[int, Allowance]]:
        """Start `generate` without waiting: the engines work while the caller does something else (scores the
        previous chunk); `collect` waits for the result."""
        refs, allowances = {}, {}
        for index, (start, end) in enumerate(split_contiguous(len(request.prompts), self.num_engines)):
            if end > start:
                refs[index] = self.engines[index].generate.remote(request.rows(start, end))
                allowances[index] = Allowance.generate(self.timeouts.rollout, end - start)
        return refs, where("generate", rollout_id), allowances

    def collect(self, pending: tuple[dict[int, Any], str, dict[int, Allowance]]) -> GenerateResult:
        """The result of a `submit`, the engines' parts joined in order."""
        refs, what, allowances = pending
        results = self._gather(refs, what, allowances, on_progress=self.on_progress)
        return GenerateResult.concat([results[i] for i in sorted(results)])

    def update_weights(
        self,
        weights: dict[str, torch.Tensor] | ray.ObjectRef,
        version: int,
        rollout_id: int | None = None,
        *,
        checksums: dict[str, TensorChecksum] | ray.ObjectRef | None = None,
    ) -> None:
        """Put the weights in the object store once (or take a ref already there); every engine loads them and,
        given the trainer's `checksums`, verifies what it loaded (a `WeightSyncError` names the tensor, the engine
        and the rollout). For tools and tests that hold a dict: a run syncs without it (`miles.ray.weight_sync`)."""
        ref = weights if isinstance(weights, ray.ObjectRef) else ray.put(weights)
        refs = {i: e.update_weights.remote(ref, version, checksums) for i, e in enumerate(self.engines)}
        self._gather(refs, where(f"weight sync (version {version})", rollout_id))

    def fill_prompt_cache(
        self,
        prompts: list[str],
        negative_prompts: list[str],
        release: bool,
        resolution: int | None = None,
        guided: bool = False,
    ) -> dict[str, int]:
        """Encode the prompt set into the prompt cache (`--prompt-cache`) once: the engines that share a cache key
        (device and thread count alike) each take a contiguous slice of the distinct prompts, a micro-batch of the
        run's generate calls (`resolution`, `guided`) at a time. Then, with `release`
        (the set is the run's whole), every engine frees its text encoders. Returns the totals found and encoded."""
        keys = self._gather({i: e.prompt_cache_key.remote() for i, e in enumerate(self.engines)}, "prompt cache key")
        distinct, refs = list(dict.fromkeys(prompts)), {}
        for key in dict.fromkeys(keys.values()):
            sharing = [i for i in sorted(keys) if keys[i] == key]
            for k, (start, end) in enumerate(split_contiguous(len(distinct), len(sharing))):
                negatives = list(negative_prompts) if k == 0 else []
                refs[sharing[k]] = self.engines[sharing[k]].fill_prompt_cache.remote(
                    distinct[start:end], negatives, resolution, guided
                )
        results = self._gather(refs, "prompt cache fill")
        if release:
            freed = self._gather({i: e.release_text_encoders.remote() for i, e in enumerate(self.engines)}, "release")
            logger.info(
                "prompt set cached: %d of %d engine(s) freed their text encoders", sum(freed.values()), len(freed)
            )
        return {name: sum(r[name] for r in results.values()) for name in ("found", "encoded")}

    def open_weight_sync(self, spec: TransportSpec, plan: SyncPlan, opener: Any = None) -> None:
        """Every engine joins the weight sync group as rank 1 + its index (with the trainer's rank 0, which the
        caller starts joining first: the call waits for all of them)."""
        refs = {i: e.open_weight_sync.remote(spec, plan, i + 1, opener) for i, e in enumerate(self.engines)}
        self._gather(refs, "joining the weight sync group")

    def submit_receive(self, version: int) -> dict[int, ray.ObjectRef]:
        """Every engine starts taking the sync the trainer's rank 0 is sending (`miles.weight_sync`) into its
        parameters, verifying each bucket's checksums; `collect_receive` waits for each."""
        return {i: e.receive_weights.remote(version) for i, e in enumerate(self.engines)}

    def collect_receive(self, refs: dict[int, ray.ObjectRef], version: int, rollout_id: int | None = None) -> None:
        """Wait for engines' `submit_receive`; a `WeightSyncError` names the tensor, the engine and the rollout."""
        self._gather(refs, where(f"weight sync (version {version})", rollout_id))

    def get_versions(self) -> list[int]:
        results = self._gather({i: e.get_version.remote() for i, e in enumerate(self.engines)}, "get_version")
        return [results[i] for i in range(self.num_engines)]

    def health(self) -> list[bool]:
        """Per engine: answered `health` in time (False for a dead or stuck engine, never an exception)."""
        alive = []
        for engine in self.engines:
            try:
                alive.append(bool(ray.get(engine.health.remote(), timeout=self.timeouts.sync_s)))
            except (RayActorError, GetTimeoutError):
                self.failed = True
                alive.append(False)
        return alive

    def shutdown(self) -> None:
        """Kill the engines or, with a pool and none failed, give them back to it once they have released what
        the run held."""
        if self.pool is not None and not self.failed:
            try:
                ray.get([e.release.remote() for e in self.engines], timeout=min(self.timeouts.sync_s, 60.0))
            except Exception as exc:  # noqa: BLE001 - an engine that cannot release is ended below with the others
                logger.warning("rollout engines could not release for reuse (%s); ending them", exc)
            else:
                held = {"CPU": self.pool_key[1], "GPU": self.pool_key[2]}
                for engine in self.engines:
                    self.pool.put(self.pool_key, engine, functools.partial(ray.kill, engine), resources=held)
                return
        for engine in self.engines:
            ray.kill(engine)

    def _gather(
        self,
        refs: dict[int, ray.ObjectRef],
        what: str,
        allowance: Allowance | dict[int, Allowance] | None = None,
        on_progress: Callable[[str], None] | None = None,
    ) -> dict[int, Any]:
        """Each engine's answer within its `allowance` (default: the sync deadline, restarted by progress reports);
        failures name the engine index."""
        if allowance is None:
            allowance = Allowance.resetting(self.timeouts.sync_s, "--rollout-sync-timeout")
        allowances = allowance if isinstance(allowance, dict) else dict.fromkeys(refs, allowance)
        wait = EngineWait(
            self.engines, what, allowances, poll_s=self.poll_s, log_every_s=self.log_every_s, on_progress=on_progress
        )
        try:
            return wait.run(refs, functools.partial(self._answer, what=what))
        except EngineError:
            self.failed = True
            raise

    def _answer(self, index: int, ref: ray.ObjectRef, what: str) -> Any:
        try:
            return ray.get(ref)
        except ACTOR_GONE as exc:
            who = f"rollout engine {index} of {self.num_engines}"
            raise start_failure(exc, who) or EngineError(f"{who} died during {what}: {exc}", index) from exc
        except WeightSyncError as exc:  # the engine is alive; the run must not sample from what it holds
            cause = exc.cause if isinstance(exc, RayTaskError) else exc
            raise WeightSyncError(f"rollout engine {index} of {self.num_engines}, {what}: {cause}") from exc
