"""The trunk's loops (ARCHITECTURE §5): one `train` call = train-input hook, micro-batch schedule, the recompute
loop, the training loop (every forward run here, frozen ones by name), the per-rollout step, the train-output hook."""

from __future__ import annotations

import argparse
import logging
import math
import time
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from miles.algorithms import FirstWindowMetrics
from miles.backends.fsdp_utils.ema import EmaConfig, ShadowWeights
from miles.backends.fsdp_utils.first_window_guard import check_first_window
from miles.backends.fsdp_utils.fsdp import clip_grad_norm_
from miles.backends.fsdp_utils.loss_hub import LossHooks
from miles.backends.fsdp_utils.loss_hub.types import DiffusionLossContext, Guidance, PreparedBatch, WindowMetrics
from miles.backends.fsdp_utils.microbatch import (
    MicroBatch,
    accumulate_gradients,
    build_microbatch_schedule,
    pairs_in_window,
    weighted_denominator,
    window_weight_totals,
)
from miles.backends.fsdp_utils.prefetch import MicrobatchPrefetcher
from miles.diffusion.reward_grad import euler_unroll
from miles.models.base import TrainPipelineConfig
from miles.models.compile import compile_counters
from miles.utils.box import Box, put_box
from miles.utils.distributed import collective_device
from miles.utils.simulation import simulating
from miles.utils.threads import torch_threads
from miles.utils.types import TrainPairs, num_pairs

logger = logging.getLogger(__name__)


class NonFiniteTrainingError(RuntimeError):
    """Too many consecutive optimizer steps were skipped because a loss or gradient norm was not finite."""


def merge_peer_output(shard: TrainPairs, peer_output: Any) -> TrainPairs:
    """The previous group's train output (per-pair columns) joins this rank's pairs as `peer/<name>` columns."""
    if peer_output is None:
        return shard
    if not isinstance(peer_output, dict):
        raise TypeError(f"a peer group's train output must be a dict of per-pair tensors, got {type(peer_output)}")
    return {**shard, **{f"peer/{key}": value for key, value in peer_output.items()}}


class TrainLoop:
    """The loops of `FSDPTrainRayActor`; the actor supplies the state (model, optimizer, hooks, networks, shadows...).

    `log_prob_ratio` is the algorithm's declaration: only then does the recompute loop run and do the formulas get
    the `write_old_log_prob` / `old_log_prob_from_new` keywords (ARCHITECTURE §6)."""

    # The state the actor supplies (`FSDPTrainRayActor.__init__` and `init`), declared here for the loops' types.
    args: argparse.Namespace
    settings: dict[str, Any]  # `role_settings`: this role's overrides
    world_size: int
    rank: int
    role: str
    device: torch.device
    forward_dtype: torch.dtype
    family: TrainPipelineConfig
    model: torch.nn.Module
    networks: Mapping[str, torch.nn.Module]  # the trained network and the frozen ones the hooks may name
    shadows: dict[str, ShadowWeights]
    hooks: LossHooks
    optimizer: torch.optim.Optimizer
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler
    ema: ShadowWeights | None
    ema_config: EmaConfig
    global_step: int
    consecutive_skips: int  # the non-finite guard's state
    first_non_finite: str
    pending_metrics: list[dict[str, Any]]  # rank 0's window records until the driver pops them
    _gradient_sync: bool

    log_prob_ratio: bool = False
    # the declared metrics of the first-window guard, until the run's first window has been checked (then None)
    first_window_metrics: FirstWindowMetrics | None = None
    train_threads: int | None = None  # torch threads while training (None: the base count)
    prefetcher: MicrobatchPrefetcher | None = None

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel group: the shard of train pairs it trains on (with its sequence-parallel peers)."""
        return self.rank // self.args.sp_size

    @property
    def dp_size(self) -> int:
        return self.world_size // self.args.sp_size

    def train(self, rollout_id: int, data: Box, peer: Box | None = None) -> Box:
        """Train on this rank's shard; returns `Box(ray.put(train_output))` for the paired rank of the next group.
        Runs with the train phase's thread count (`set_train_threads`)."""
        shard: TrainPairs = data.get()
        return put_box(self.train_pairs(rollout_id, shard, None if peer is None else peer.get()))

    def train_pairs(self, rollout_id: int, shard: TrainPairs, peer_output: Any = None) -> Any:
        """`train` on a shard in hand, without Ray (`scripts/gpu_check.sh --no-setup` calls it): returns the
        algorithm's train output for the next group."""
        with torch_threads(self.train_threads):
            return self._train(rollout_id, shard, peer_output)

    def _train(self, rollout_id: int, shard: TrainPairs, peer_output: Any) -> Any:
        ctx = self._make_context(rollout_id)
        if peer_output is not None:
            shard = merge_peer_output(shard, peer_output)
        pairs = self.hooks.train_input(ctx, shard)
        schedule = build_microbatch_schedule(
            num_pairs(pairs), self.settings["num_steps_per_rollout"], self.settings["micro_batch_size"]
        )
        self._check_same_schedule_on_all_ranks(schedule)
        train_output_inputs = self._train_core(ctx, pairs, schedule)
        self._update_shadows(ctx)
        return self.hooks.train_output(ctx, pairs, train_output_inputs)

    def _make_context(self, rollout_id: int) -> DiffusionLossContext:
        return DiffusionLossContext(
            args=self.args,
            role=self.role,
            rollout_id=rollout_id,
            dp_rank=self.dp_rank,
            dp_size=self.dp_size,
            device=self.device,
            forward_dtype=self.forward_dtype,
            family=self.family,
            networks=self.networks,
        )

    def _update_shadows(self, ctx: DiffusionLossContext) -> None:
        """The entry's per-rollout step: θ_s ← d·θ_s + (1 − d)·θ for each declared shadow it returns a decay for."""
        for name, decay in self.hooks.after_train(ctx, global_step=self.global_step).items():
            if name not in self.shadows:
                raise KeyError(
                    f"the {self.role}'s after_train hook returned a decay for {name!r}, which is not a shadow "
                    f"network of its declaration (shadows: {sorted(self.shadows)})"
                )
            self.shadows[name].update(decay)

    def _ratio_keywords(self, *, write: bool, from_new: bool) -> dict[str, bool]:
        """The recompute keywords of a formula call, passed only to algorithms with a log-prob ratio."""
        return {"write_old_log_prob": write, "old_log_prob_from_new": from_new} if self.log_prob_ratio else {}

    def _check_same_schedule_on_all_ranks(self, schedule: list[list[MicroBatch]]) -> None:
        """Different micro-batch counts would hang the collectives: fail on every rank before any forward."""
        count = torch.tensor([sum(len(w) for w in schedule)], dtype=torch.int64, device=collective_device())
        counts = [torch.zeros_like(count) for _ in range(self.world_size)]
        dist.all_gather(counts, count)
        values = [int(c.item()) for c in counts]
        if len(set(values)) != 1:
            raise RuntimeError(f"{self.role} ranks have different micro-batch counts {values}: shards must be equal")

    def _train_core(self, ctx: DiffusionLossContext, pairs: TrainPairs, schedule: list[list[MicroBatch]]) -> list:
        """The recompute loop (windows 1..), then the training loop; owns the list the train-output hook reads."""
        train_output_inputs: list = []
        recompute = self.log_prob_ratio and bool(self.args.diffusion_recompute_old_log_prob)
        if recompute:
            self.recompute_old_log_probs(ctx, pairs, schedule, train_output_inputs)
        denominators = self._window_denominators(pairs, schedule)
        for optim_step_idx, window in enumerate(schedule):
            started = time.perf_counter()
            self.optimizer.zero_grad(set_to_none=True)
            metrics = WindowMetrics()
            denominator = denominators[optim_step_idx]
            losses_finite = True
            for mb_idx, (_, batch, prepared) in enumerate(self._prepared(ctx, pairs, window, optim_step_idx)):
                self._set_gradient_sync(mb_idx == len(window) - 1)
                loss_sum = self.hooks.formula(
                    ctx,
                    batch,
                    prepared,
                    **self._forward(prepared),
                    metrics=metrics,
                    optim_step_idx=optim_step_idx,
                    train_output_inputs=train_output_inputs,
                    **self._ratio_keywords(write=False, from_new=recompute and optim_step_idx == 0),
                )
                losses_finite = losses_finite and bool(torch.isfinite(loss_sum.detach()).all())
                (loss_sum / denominator).backward()
            grad_norm = clip_grad_norm_(self.model.parameters(), self.args.clip_grad)
            lr = self.optimizer.param_groups[0]["lr"]
            skipped = self._skip_non_finite(ctx, optim_step_idx, losses_finite, grad_norm)
            if not skipped:
                self.optimizer.step()
                self.lr_scheduler.step()
                self.global_step += 1
                if self.ema is not None and self.ema_config.due(self.global_step):
                    self.ema.update(self.ema_config.decay_at(self.global_step))
            metrics.add("train/skipped_steps", float(skipped))
            record = self._record_window(ctx, metrics, grad_norm, lr, time.perf_counter() - started)
            if self.first_window_metrics is not None:  # window 0 of the run's first train call
                self._check_first_window(ctx, record)
        return train_output_inputs

    def _window_denominators(self, pairs: TrainPairs, schedule: list[list[MicroBatch]]) -> list[float]:
        """What each window's loss sums are divided by: the window's pair count, or under the entry's `pair_weight`
        column the count scaled by the window's weight per pair over every rank (`weighted_denominator`: the step
        follows the mean over the pairs that train). One all-reduce per train call, only with a pair weight."""
        column = self.hooks.pair_weight
        if column is None:
            return [pairs_in_window(window) for window in schedule]
        if column not in pairs:
            raise KeyError(
                f"the {self.role}'s train pairs have no {column!r} column, which its loss hooks name as the pair "
                f"weight (LossHooks.pair_weight): its rollout side must write it (columns: {sorted(pairs)})"
            )
        totals = window_weight_totals(pairs[column], schedule)
        if self.world_size > 1:
            totals = totals.to(collective_device())
            dist.all_reduce(totals)
        return [weighted_denominator(w, s, n) for w, (s, n) in zip(schedule, totals.cpu().tolist())]

    def _check_first_window(self, ctx: DiffusionLossContext, record: dict[str, Any]) -> None:
        """The first-window guard, once per run, on every rank alike (the record is reduced over dp): no rank
        raises alone into the next collective."""
        keys, self.first_window_metrics = self.first_window_metrics, None
        if keys is None or simulating():  # checked already (the caller tests it); the plan's fake tensors: no values
            return
        if self.args.allow_rollout_mismatch and self.rank != 0:
            return  # rank 0 warns for every rank
        problem = check_first_window(
            record,
            keys,
            self.args.diffusion_forward_dtype,
            allow_mismatch=self.args.allow_rollout_mismatch,
            role=self.role,
            rollout_id=ctx.rollout_id,
        )
        if problem is not None:  # the warning, in metrics.jsonl too (the record rank 0 hands the driver)
            record["train/rollout_mismatch"] = 1.0

    def _skip_non_finite(self, ctx: DiffusionLossContext, window: int, losses_finite: bool, grad_norm: float) -> bool:
        """The non-finite guard: one decision for every rank (any rank's non-finite loss or gradient norm skips the
        window's optimizer step everywhere). After --max-skipped-steps consecutive skips the run stops, naming
        what went non-finite first, before anything is saved."""
        bad = [not losses_finite, not math.isfinite(grad_norm)]
        if self.world_size > 1:
            flags = torch.tensor(bad, dtype=torch.float32, device=collective_device())
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            bad = [bool(f) for f in flags.tolist()]
        if not any(bad):
            self.consecutive_skips = 0
            return False
        self.optimizer.zero_grad(set_to_none=True)
        what = "the loss" if bad[0] else f"the gradient norm ({grad_norm})"
        where = f"{self.role} rollout {ctx.rollout_id} window {window}"
        if self.consecutive_skips == 0:
            self.first_non_finite = f"{what} at {where}"
        self.consecutive_skips += 1
        logger.warning("%s: %s is not finite; optimizer step skipped on every rank", where, what)
        if self.consecutive_skips >= self.args.max_skipped_steps:
            raise NonFiniteTrainingError(
                f"{self.role}: {self.consecutive_skips} consecutive optimizer steps skipped (--max-skipped-steps "
                f"{self.args.max_skipped_steps}); first non-finite: {self.first_non_finite}. Stopped before any "
                "save: check the loss formula and out-of-range settings (e.g. --diffusion-noise-level)."
            )
        return True

    def _set_gradient_sync(self, last_in_window: bool) -> None:
        """What FSDP2 communicates after this micro-batch's backward (`microbatch.accumulate_gradients`)."""
        if self._gradient_sync == last_in_window:
            return
        accumulate_gradients(
            cast(FSDPModule, self.model),  # `apply_fsdp2` made the root an FSDPModule
            last_in_window,
            world_size=self.world_size,
            cpu_offload=self.args.fsdp_cpu_offload,
        )
        self._gradient_sync = last_in_window

    @torch.no_grad()
    def recompute_old_log_probs(
        self, ctx: DiffusionLossContext, pairs: TrainPairs, schedule: list[list[MicroBatch]], train_output_inputs: list
    ) -> None:
        """Before any update, store old log-probs of windows 1.. with the exact ids their training pass uses."""
        for optim_step_idx, window in enumerate(schedule):
            if optim_step_idx == 0:
                continue
            for _, batch, prepared in self._prepared(ctx, pairs, window, optim_step_idx):
                self.hooks.formula(
                    ctx,
                    batch,
                    prepared,
                    **self._forward(prepared),
                    metrics=WindowMetrics(),
                    optim_step_idx=optim_step_idx,
                    train_output_inputs=train_output_inputs,
                    **self._ratio_keywords(write=True, from_new=False),
                )

    def _prepared(
        self, ctx: DiffusionLossContext, pairs: TrainPairs, window: list[MicroBatch], optim_step_idx: int
    ) -> Iterator[tuple[MicroBatch, TrainPairs, PreparedBatch]]:
        """Each micro-batch of a window with its pairs and its prepare hook's batch, in order; with
        `--prefetch-microbatches` the next one is prepared while the caller computes this one (`prefetch.py`)."""
        prefetcher = self.prefetcher or MicrobatchPrefetcher(False, ctx.device)
        return prefetcher.prepared(self.hooks.prepare, ctx, pairs, window, optim_step_idx)

    def _forward(self, prepared: PreparedBatch) -> dict[str, Any]:
        """The actor owns every forward: the frozen networks the prepare names (without grad), then the trained one.

        Returns the formula's prediction keywords: `new_pred` and `frozen_preds` (read-only, name -> prediction)."""
        frozen: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name in dict.fromkeys(prepared.frozen_networks):  # each once, in the order named
                frozen[name] = self._predict(self._frozen_network(name), prepared, prepared.guidance_of(name))
        guidance = Guidance(prepared.guidance_scale, prepared.negative)
        if prepared.unroll_sigmas is None:
            return {"new_pred": self._predict(self.model, prepared, guidance), "frozen_preds": MappingProxyType(frozen)}

        def velocity(x: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
            return self._predict(self.model, prepared, guidance, latents=x, sigmas=sigmas)

        grid = prepared.unroll_sigmas.to(prepared.latents.device)
        # one step keeps its activations (recomputing it would only cost a forward); K > 1 checkpoints each step
        unrolled, first = euler_unroll(velocity, prepared.latents, grid, per_step_checkpoint=grid.numel() > 2)
        return {"new_pred": first, "frozen_preds": MappingProxyType(frozen), "unrolled": unrolled}

    def _frozen_network(self, name: str) -> torch.nn.Module:
        """A frozen network by name: a view of the trained module (LoRA base, EMA, shadow weights) or a separate one."""
        if name not in self.networks:
            raise KeyError(
                f"a prepare hook named frozen network {name!r}; this {self.role} holds {sorted(self.networks)} (its "
                "declaration's frozen networks, a checkpoint one only when its path flag is given, and `ref` with "
                "--ref-mode)"
            )
        return self.networks[name]

    def _predict(
        self,
        network: torch.nn.Module,
        prepared: PreparedBatch,
        guidance: Guidance,
        *,
        latents: torch.Tensor | None = None,
        sigmas: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`network`'s velocity on the prepared batch (or at other `latents` / `sigmas`, an unrolled step's)."""
        return self.family.predict_velocity(
            network,
            prepared.latents if latents is None else latents,
            prepared.sigmas if sigmas is None else sigmas,
            prepared.embeds,
            guidance_scale=guidance.scale,
            negative=guidance.negative,
        )

    def _record_window(
        self, ctx: DiffusionLossContext, metrics: WindowMetrics, grad_norm: float, lr: float, seconds: float
    ) -> dict[str, Any]:
        """The window's metrics reduced over dp (the same record on every rank); rank 0 keeps it for the driver."""
        names = sorted(metrics.sums)
        totals = metrics.totals(names) if names else torch.zeros(0, 2, dtype=torch.float64)
        if self.world_size > 1 and names:
            totals = totals.to(collective_device())
            dist.all_reduce(totals)
        totals = totals.cpu()  # the window's one transfer
        record: dict[str, Any] = {"rollout_id": ctx.rollout_id, "step": self.global_step, "role": self.role}
        record.update({n: float(s / max(c, 1.0)) for n, (s, c) in zip(names, totals.tolist())})
        record.update({"train/grad_norm": float(grad_norm), "train/lr": float(lr), "perf/train_step_s": seconds})
        if self.args.compile != "off":  # this rank's process totals (rank 0's go to the driver)
            record.update({f"perf/{name}": value for name, value in compile_counters().items()})
        if self.rank == 0:
            self.pending_metrics.append(record)
        return record

    def pop_metrics(self) -> list[dict[str, Any]]:
        records, self.pending_metrics = self.pending_metrics, []
        return records
