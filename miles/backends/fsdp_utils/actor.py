"""The trunk: one FSDP2 trainer actor class for every role, running the recompute and training loops (§5)."""

from __future__ import annotations

import argparse
import logging
import os
import random
import socket
import time
from types import MappingProxyType
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from miles.backends.fsdp_utils.checkpoint import load_checkpoint, read_latest, save_checkpoint
from miles.backends.fsdp_utils.ema import ShadowWeights, ema_config_from_args
from miles.backends.fsdp_utils.fsdp import apply_fsdp2, clip_grad_norm_, full_state_dict, parse_dtype
from miles.backends.fsdp_utils.lora import (
    LoraBaseNetwork,
    apply_lora,
    lora_config_from_args,
    lora_state_dict,
    save_lora_adapter,
)
from miles.backends.fsdp_utils.loss_hub import LossHooks, get_loss_hooks
from miles.backends.fsdp_utils.loss_hub.nft import nft_old_decay
from miles.backends.fsdp_utils.loss_hub.types import DiffusionLossContext, PreparedBatch, WindowMetrics
from miles.backends.fsdp_utils.microbatch import MicroBatch, build_microbatch_schedule, pairs_in_window
from miles.backends.fsdp_utils.optim import build_lr_scheduler, build_optimizer
from miles.models.base import get_train_pipeline_config
from miles.utils.box import Box
from miles.utils.distributed import collective_device, destroy_process_group, init_process_group
from miles.utils.types import TrainPairs, num_pairs, slice_pairs

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def role_settings(args: argparse.Namespace, role: str) -> dict[str, Any]:
    """What differs between roles: only the critic overrides (§8); everything else is shared."""
    if role == "critic":
        return {
            "checkpoint": args.critic_checkpoint,
            "lr": args.critic_lr,
            "load": args.critic_load,
            "save": args.critic_save,
            "num_steps_per_rollout": args.critic_num_steps_per_rollout,
            "micro_batch_size": args.critic_micro_batch_size,
        }
    return {
        "checkpoint": args.hf_checkpoint,
        "lr": args.lr,
        "load": args.load,
        "save": args.save,
        "num_steps_per_rollout": args.num_steps_per_rollout,
        "micro_batch_size": args.micro_batch_size,
    }


def holds_teacher(args: argparse.Namespace, role: str) -> bool:
    """Where the frozen `--teacher-load` network lives: the dmd2 critic (its train-output hook runs it), or the
    custom_loss actor (its hooks may read `ctx.networks["teacher"]`); the built-in losses elsewhere never read it."""
    if not args.teacher_load:
        return False
    return (args.loss_type, role) in (("dmd2", "critic"), ("custom_loss", "actor"))


def merge_peer_output(shard: TrainPairs, peer_output: Any) -> TrainPairs:
    """The previous group's train output (per-pair columns) joins this rank's pairs as `peer/<name>` columns."""
    if peer_output is None:
        return shard
    if not isinstance(peer_output, dict):
        raise TypeError(f"a peer group's train output must be a dict of per-pair tensors, got {type(peer_output)}")
    return {**shard, **{f"peer/{key}": value for key, value in peer_output.items()}}


class FSDPTrainRayActor:
    """One data-parallel rank of one role; wrapped by `ray.remote` in `miles.ray.train_group`."""

    def __init__(self, world_size: int, rank: int, role: str) -> None:
        self.world_size, self.rank, self.role = world_size, rank, role
        self.global_step = 0
        self.pending_metrics: list[dict[str, Any]] = []
        self._gradient_sync = True  # FSDP2's default: reduce-scatter and reshard after every backward

    # ---- set-up -------------------------------------------------------------------------------
    def get_master_address(self) -> tuple[str, int]:
        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return socket.gethostbyname(socket.gethostname()) if torch.cuda.is_available() else "127.0.0.1", port

    def init(self, args: argparse.Namespace, master_addr: str, master_port: int) -> int:
        """Process group, network, FSDP2, optimizer, schedule and `--load` state; returns the first rollout id."""
        logging.basicConfig(level=getattr(logging, args.log_level), format="%(asctime)s %(name)s: %(message)s")
        self.args = args
        self.settings = role_settings(args, self.role)
        self.device = resolve_device(args.device)
        if self.device.type == "cpu":
            torch.set_num_threads(max(1, round(args.cpus_per_rank)))
        init_process_group(self.rank, self.world_size, master_addr, master_port, self.device)
        self._seed_everything(args.seed + self.rank)
        self.forward_dtype = parse_dtype(args.diffusion_forward_dtype)
        self.family = get_train_pipeline_config(args.hf_checkpoint, args.model_family)
        self.model = self.family.load_transformer(self.settings["checkpoint"]).to(self.device)
        self.model.train()
        self.lora_config = lora_config_from_args(args, self.family.name) if args.use_lora else None
        if self.lora_config is not None:
            apply_lora(self.model, self.lora_config)
        apply_fsdp2(
            self.model,
            self.family.transformer_blocks(self.model),
            param_dtype=self.forward_dtype,
            reduce_dtype=parse_dtype(args.fsdp_reduce_dtype),
        )
        self.hooks: LossHooks = get_loss_hooks(args, self.role)
        self.optimizer = build_optimizer(self.model.parameters(), args, self.settings["lr"])
        total_steps = args.num_rollout * self.settings["num_steps_per_rollout"]
        self.lr_scheduler = build_lr_scheduler(self.optimizer, args, self.settings["lr"], total_steps)
        self.ema_config = ema_config_from_args(args)
        self.ema = ShadowWeights(self.model) if self.ema_config.enabled else None
        self.old = ShadowWeights(self.model) if args.loss_type == "nft" else None  # NFT's decayed old policy
        self.networks = MappingProxyType(self._build_networks())
        return self._load()

    def _build_networks(self) -> dict[str, torch.nn.Module]:
        """The trained network and the frozen views the hooks may name (`ref`: LoRA base or EMA weights)."""
        networks: dict[str, torch.nn.Module] = {"policy": self.model}
        if self.args.ref_mode == "lora_base":
            networks["ref"] = LoraBaseNetwork(self.model)
        elif self.args.ref_mode == "ema":
            networks["ref"] = self.ema.network(self.model)
        if self.old is not None:
            networks["old"] = self.old.network(self.model)
        if holds_teacher(self.args, self.role):
            networks["teacher"] = self._load_frozen(self.args.teacher_load)
        return networks

    def _load_frozen(self, path: str) -> torch.nn.Module:
        """A frozen network (eval, no grad, no optimizer), sharded with FSDP2 like the trained one."""
        network = self.family.load_transformer(path).to(self.device).eval()
        network.requires_grad_(False)
        return apply_fsdp2(
            network,
            self.family.transformer_blocks(network),
            param_dtype=self.forward_dtype,
            reduce_dtype=parse_dtype(self.args.fsdp_reduce_dtype),
        )

    def _sharded_state(self) -> dict[str, dict[str, torch.Tensor]]:
        state = {}
        if self.ema is not None:
            state["ema"] = self.ema.state_dict()
        if self.old is not None:
            state["nft_old"] = self.old.state_dict()
        return state

    def _seed_everything(self, seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed % (2**32))
        torch.manual_seed(seed)

    def _load(self) -> int:
        load_dir = self.settings["load"]
        if not load_dir or read_latest(load_dir) is None:
            if load_dir:
                logger.info("no checkpoint in %s yet: starting from rollout 0", load_dir)
            return 0
        loaded = load_checkpoint(
            load_dir,
            self.role,
            model=self.model,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            load_optimizer=not self.args.no_load_optim,
            sharded=self._sharded_state(),
            verify_checksums=not self.args.skip_checkpoint_checksums,
        )
        self.global_step = int(loaded.meta.get("global_step", 0))
        logger.info("%s rank %d resumed from %s at rollout %d", self.role, self.rank, load_dir, loaded.rollout_id)
        return loaded.rollout_id + 1

    # ---- training -----------------------------------------------------------------------------
    def train(self, rollout_id: int, data: Box, peer: Box | None = None) -> Box:
        """Train on this rank's shard; returns `Box(ray.put(train_output))` for the paired rank of the next group."""
        import ray

        ctx = self._make_context(rollout_id)
        shard: TrainPairs = ray.get(data.inner)
        if peer is not None:
            shard = merge_peer_output(shard, ray.get(peer.inner))
        pairs = self.hooks.train_input(ctx, shard)
        schedule = build_microbatch_schedule(
            num_pairs(pairs), self.settings["num_steps_per_rollout"], self.settings["micro_batch_size"]
        )
        self._check_same_schedule_on_all_ranks(schedule)
        train_output_inputs = self._train_core(ctx, pairs, schedule)
        if self.old is not None:  # θ_old ← d·θ_old + (1 − d)·θ once per rollout (DiffusionNFT)
            self.old.update(nft_old_decay(self.args, self.global_step))
        output = self.hooks.train_output(ctx, pairs, train_output_inputs)
        return Box(ray.put(output))

    def _make_context(self, rollout_id: int) -> DiffusionLossContext:
        return DiffusionLossContext(
            args=self.args,
            role=self.role,
            rollout_id=rollout_id,
            dp_rank=self.rank,
            dp_size=self.world_size,
            device=self.device,
            forward_dtype=self.forward_dtype,
            family=self.family,
            networks=self.networks,
        )

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
        recompute = bool(self.args.diffusion_recompute_old_log_prob)
        if recompute:
            self.recompute_old_log_probs(ctx, pairs, schedule, train_output_inputs)
        for optim_step_idx, window in enumerate(schedule):
            started = time.perf_counter()
            self.optimizer.zero_grad(set_to_none=True)
            metrics = WindowMetrics()
            denominator = pairs_in_window(window)
            for mb_idx, mb in enumerate(window):
                self._set_gradient_sync(mb_idx == len(window) - 1)
                batch = slice_pairs(pairs, mb.start, mb.end)
                prepared = self.hooks.prepare(ctx, batch, microbatch_id=mb.microbatch_id, optim_step_idx=optim_step_idx)
                new_pred, ref_pred = self._forward(prepared)
                loss_sum = self.hooks.formula(
                    ctx,
                    batch,
                    prepared,
                    new_pred=new_pred,
                    ref_pred=ref_pred,
                    metrics=metrics,
                    optim_step_idx=optim_step_idx,
                    train_output_inputs=train_output_inputs,
                    write_old_log_prob=False,
                    old_log_prob_from_new=recompute and optim_step_idx == 0,
                )
                (loss_sum / denominator).backward()
            grad_norm = clip_grad_norm_(self.model.parameters(), self.args.clip_grad)
            lr = self.optimizer.param_groups[0]["lr"]
            self.optimizer.step()
            self.lr_scheduler.step()
            self.global_step += 1
            if self.ema is not None and self.ema_config.due(self.global_step):
                self.ema.update(self.ema_config.decay_at(self.global_step))
            self._record_window(ctx, metrics, grad_norm, lr, time.perf_counter() - started)
        return train_output_inputs

    def _set_gradient_sync(self, last_in_window: bool) -> None:
        """At world size 1 one rank holds every shard: accumulate full gradients and keep the blocks gathered
        until the window's last backward, instead of a reduce-scatter and a reshard after every micro-batch.

        With more ranks every backward reduce-scatters, so gradients stay sharded (the memory FSDP2 is for).
        """
        if self.world_size > 1 or self._gradient_sync == last_in_window:
            return
        self.model.set_requires_gradient_sync(last_in_window)
        self.model.set_reshard_after_backward(last_in_window)
        self._gradient_sync = last_in_window

    @torch.no_grad()
    def recompute_old_log_probs(
        self, ctx: DiffusionLossContext, pairs: TrainPairs, schedule: list[list[MicroBatch]], train_output_inputs: list
    ) -> None:
        """Before any update, store old log-probs of windows 1.. with the exact ids their training pass uses."""
        for optim_step_idx, window in enumerate(schedule):
            if optim_step_idx == 0:
                continue
            for mb in window:
                batch = slice_pairs(pairs, mb.start, mb.end)
                prepared = self.hooks.prepare(ctx, batch, microbatch_id=mb.microbatch_id, optim_step_idx=optim_step_idx)
                new_pred, ref_pred = self._forward(prepared)
                self.hooks.formula(
                    ctx,
                    batch,
                    prepared,
                    new_pred=new_pred,
                    ref_pred=ref_pred,
                    metrics=WindowMetrics(),
                    optim_step_idx=optim_step_idx,
                    train_output_inputs=train_output_inputs,
                    write_old_log_prob=True,
                    old_log_prob_from_new=False,
                )

    def _forward(self, prepared: PreparedBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The actor owns every forward: the frozen network the hook names first, then the trained one."""
        ref_pred = None
        if prepared.ref_network is not None:
            with torch.no_grad():
                ref_pred = self._predict_frozen(prepared.ref_network, prepared)
        return self._predict(self.model, prepared), ref_pred

    def _predict_frozen(self, name: str, prepared: PreparedBatch) -> torch.Tensor:
        """A frozen network by name: a view of the trained module (LoRA base, EMA weights) or a separate one."""
        if name not in self.networks:
            raise KeyError(f"hook asked for network {name!r}; this {self.role} has {sorted(self.networks)}")
        return self._predict(self.networks[name], prepared)

    def _predict(self, network: torch.nn.Module, prepared: PreparedBatch) -> torch.Tensor:
        return self.family.predict_velocity(
            network,
            prepared.latents,
            prepared.sigmas,
            prepared.embeds,
            guidance_scale=prepared.guidance_scale,
            negative=prepared.negative,
        )

    def _record_window(
        self, ctx: DiffusionLossContext, metrics: WindowMetrics, grad_norm: float, lr: float, seconds: float
    ) -> None:
        names = sorted(metrics.sums)
        totals = torch.tensor([[metrics.sums[n], metrics.counts[n]] for n in names], dtype=torch.float64)
        if self.world_size > 1 and names:
            totals = totals.to(collective_device())
            dist.all_reduce(totals)
            totals = totals.cpu()
        record: dict[str, Any] = {"rollout_id": ctx.rollout_id, "step": self.global_step, "role": self.role}
        record.update({n: float(s / max(c, 1.0)) for n, (s, c) in zip(names, totals.tolist())})
        record.update({"train/grad_norm": float(grad_norm), "train/lr": float(lr), "perf/train_step_s": seconds})
        if self.rank == 0:
            self.pending_metrics.append(record)

    def pop_metrics(self) -> list[dict[str, Any]]:
        records, self.pending_metrics = self.pending_metrics, []
        return records

    # ---- weights and checkpoints --------------------------------------------------------------
    def save(self, rollout_id: int, extra: dict | None = None) -> str:
        return save_checkpoint(
            self.settings["save"],
            rollout_id,
            self.role,
            model=self.model,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            extra=extra,
            meta={"global_step": self.global_step, "loss_type": self.args.loss_type},
            sharded=self._sharded_state(),
        )

    def export_weights(self) -> dict[str, torch.Tensor] | None:
        """Weights for the rollout engines on rank 0 (None elsewhere); collective.

        EMA weights with `--ema-rollout-policy ema`, the live ones otherwise; only the LoRA entries with LoRA.
        """
        if self.old is not None:  # NFT samples its rollouts with the old policy
            state = self.old.full_state_dict(self.model)
        elif self.ema is not None and self.args.ema_rollout_policy == "ema":
            state = self.ema.full_state_dict(self.model)
        else:
            state = full_state_dict(self.model)
        if self.rank != 0:
            return None
        return lora_state_dict(state) if self.lora_config is not None else state

    def full_state_dict_every_rank(self) -> dict[str, torch.Tensor]:
        """Each rank's own gather of the full weights (to check that ranks agree)."""
        return {k: v.detach().cpu() for k, v in full_state_dict(self.model, cpu_offload=False).items()}

    def network_state_dict_every_rank(self, name: str) -> dict[str, torch.Tensor]:
        """Each rank's gather of a named network's full weights (`policy`, `teacher`, ...; tests and tools)."""
        network = self.networks[name]
        return {k: v.detach().cpu() for k, v in full_state_dict(network, cpu_offload=False).items()}

    def save_hf(self, out_dir: str) -> str | None:
        """A diffusers pipeline folder with the trained transformer, or a PEFT LoRA adapter folder with LoRA."""
        state = full_state_dict(self.model)
        if self.rank != 0:
            return None
        os.makedirs(out_dir, exist_ok=True)
        if self.lora_config is not None:
            save_lora_adapter(lora_state_dict(state), self.lora_config, out_dir, self.family.pipeline_class_name)
        else:
            self.family.save_transformer(state, out_dir)
        return out_dir

    def shutdown(self) -> None:
        destroy_process_group()
