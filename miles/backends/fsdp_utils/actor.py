"""The trunk: one FSDP2 trainer actor class for every role; its life cycle (set-up, networks, checkpoints, weights
for the engines) lives here, its loops in `train_loop.py` (§5). It names no loss type: the algorithm's declaration
says which frozen networks a role holds, its loss-hub entry what the trunk does for its hooks."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import socket
from types import MappingProxyType
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from miles.algorithms import FrozenNetwork, algorithm_of, role_flag, role_settings
from miles.backends.fsdp_utils.checkpoint import LoadedCheckpoint, load_checkpoint, read_latest, save_checkpoint
from miles.backends.fsdp_utils.ema import ShadowWeights, ema_config_from_args, local_tensor, reshard
from miles.backends.fsdp_utils.engine_export import EngineExport
from miles.backends.fsdp_utils.fsdp import apply_fsdp2, build_mesh, parse_dtype
from miles.backends.fsdp_utils.gather import full_state_dict
from miles.backends.fsdp_utils.lora import (
    LoraBaseNetwork,
    apply_lora,
    lora_config_from_args,
)
from miles.backends.fsdp_utils.loss_hub import LossHooks, checkpoint_meta, get_loss_hooks
from miles.backends.fsdp_utils.optim import OptimizerFlags, build_lr_scheduler, build_optimizer, scale_learning_rate
from miles.backends.fsdp_utils.prefetch import MicrobatchPrefetcher, prefetch_enabled
from miles.backends.fsdp_utils.sharded_load import load_sharded
from miles.backends.fsdp_utils.train_loop import TrainLoop
from miles.backends.fsdp_utils.weight_push import WeightPusher, sync_plan
from miles.models.base import family_options, get_train_pipeline_config
from miles.models.sequence_parallel import SequenceParallelGroup, new_sequence_parallel_group
from miles.utils.distributed import (
    collective_device,
    destroy_process_group,
    init_process_group,
    resolve_device,
    use_deterministic_algorithms,
)
from miles.utils.heap import TRAINER_MMAP_THRESHOLD, keep_freed_memory
from miles.utils.misc import load_module
from miles.utils.offload import HostSwap
from miles.utils.seeding import seed_everything
from miles.utils.threads import gpu_rank_threads, node_info
from miles.utils.weight_checksum import TensorChecksum
from miles.weight_sync.protocol import SyncPlan
from miles.weight_sync.transports import TransportSpec

logger = logging.getLogger(__name__)
SHADOW_CHECKPOINT_KEYS = {"old": "nft_old"}  # the name checkpoints written before the loss-hub declarations use


class FSDPTrainRayActor(TrainLoop):
    """One rank of one role (data-parallel group `dp_rank`, sequence-parallel rank `rank % sp_size` within it);
    wrapped by `ray.remote` in `miles.ray.train_group`."""

    def __init__(self, world_size: int, rank: int, role: str) -> None:
        self.world_size, self.rank, self.role = world_size, rank, role
        self.sp: SequenceParallelGroup | None = None  # this rank's sequence-parallel group (--sp-size > 1), from init
        self.global_step = 0
        self.consecutive_skips, self.first_non_finite = 0, ""  # the non-finite guard's state (train_loop.py)
        self.pending_metrics: list[dict[str, Any]] = []
        self._gradient_sync = True  # FSDP2's default: reduce-scatter and reshard after every backward
        self.train_threads: int | None = None  # torch threads while training (None: the base count)
        self.loaded: dict[str, torch.nn.Module] = {}  # the frozen networks loaded from a checkpoint (a teacher)
        self.pusher: WeightPusher | None = None  # the weight sync's trainer end, from prepare_weight_sync

    # ---- set-up -------------------------------------------------------------------------------
    def get_master_address(self) -> tuple[str, int]:
        """Rank 0's node IP as Ray knows it (reachable from the other nodes, on CPU and GPU alike) and a free port."""
        import ray  # here only: the trainer is importable and callable without Ray (scripts/gpu_check.sh --no-setup)

        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def node_info(self) -> tuple[str, int]:
        """(Ray node id, cores) of this rank's process."""
        return node_info()

    def set_train_threads(self, count: int | None) -> None:
        """Torch threads for `train` (the recompute and training loops) on CPU; None: the base count."""
        self.train_threads = count

    def init(self, args: argparse.Namespace, master_addr: str, master_port: int) -> int:
        """Process group, network, FSDP2, optimizer, schedule and `--load` state; returns the first rollout id."""
        logging.basicConfig(level=getattr(logging, args.log_level), format="%(asctime)s %(name)s: %(message)s")
        self.args = args
        self.settings = role_settings(args, self.role)
        self.device = resolve_device(args.device)
        self._set_up_process(args.cpus_per_rank)
        if args.deterministic_mode:
            use_deterministic_algorithms()
        self._join_process_group(master_addr, master_port)
        self.sp = new_sequence_parallel_group(args.sp_size)
        # the ranks of a sequence-parallel group draw alike: they compute one data-parallel rank's pairs together
        seed_everything(args.seed + self.dp_rank)
        self.forward_dtype = parse_dtype(args.diffusion_forward_dtype)
        self.family = get_train_pipeline_config(args.hf_checkpoint, args.model_family, **family_options(args))
        master_dtype = parse_dtype(args.fsdp_master_dtype)  # what the optimizer updates; forwards cast to forward_dtype
        self.lora_config = lora_config_from_args(args, self.family.name) if args.use_lora else None
        # built on the meta device, sharded, then each rank reads its own rows of the checkpoint (sharded_load.py)
        self.model = load_sharded(
            self.family,
            self.settings["checkpoint"],
            dtype=master_dtype,
            device=self._home(),
            prepare=self._prepare_trained,
            shard=lambda model: apply_fsdp2(
                model,
                self.family.transformer_blocks(model),
                param_dtype=self.forward_dtype,
                reduce_dtype=parse_dtype(args.fsdp_reduce_dtype),
                cast_root_inputs=False,  # the family's predict_velocity casts, exactly as in the engines
                gradient_checkpointing=args.gradient_checkpointing,
                compile_mode=args.compile,
                split_blocks=args.use_lora,  # a frozen base: gathered a block's child at a time
                **self._placement(),
            ),
        )
        self.model.train()
        if args.algorithm_path:  # registers its loss types in this process too
            load_module(args.algorithm_path)
        self.hooks: LossHooks = get_loss_hooks(args, self.role)
        algorithm = algorithm_of(args)
        self.log_prob_ratio = algorithm.log_prob_ratio
        # the first-window guard checks the actor (the role the engines sample) before the run's first update
        self.first_window_metrics = algorithm.first_window_metrics if self.role == "actor" else None
        self.frozen: tuple[FrozenNetwork, ...] = algorithm.role(self.role).frozen_networks
        self.prefetcher = MicrobatchPrefetcher(prefetch_enabled(args, self.device), self.device)
        optimizer_flags = OptimizerFlags.from_args(args)
        self.optimizer = build_optimizer(self.model.parameters(), optimizer_flags, self.settings["lr"])
        total_steps = args.num_rollout * self.settings["num_steps_per_rollout"]
        self.lr_scheduler = build_lr_scheduler(self.optimizer, optimizer_flags, self.settings["lr"], total_steps)
        self.ema_config = ema_config_from_args(args)
        self.ema = ShadowWeights(self.model) if self.ema_config.enabled else None
        # the declared shadow networks (NFT's old policy): copies of the trained weights the per-rollout step moves
        self.shadows = {n.name: ShadowWeights(self.model) for n in self.frozen if n.source == "shadow"}
        self.networks = MappingProxyType(self._build_networks())
        self.swap = HostSwap(self.device)  # sleep / wake (--colocate-sleep)
        return self._load()

    def _set_up_process(self, cpus_per_rank: float) -> None:
        """This rank's torch threads (and, on CPU, its heap) for `self.device`."""
        if self.device.type == "cpu":
            torch.set_num_threads(max(1, round(cpus_per_rank)))
            # each micro-batch reuses the heap the last one freed, except blocks of 4 MiB or more (FSDP2's gathered
            # parameters among them), which go back to the kernel when freed (miles.utils.heap)
            keep_freed_memory(mmap_threshold=TRAINER_MMAP_THRESHOLD)
        else:
            torch.set_num_threads(gpu_rank_threads())

    def _join_process_group(self, master_addr: str, master_port: int) -> None:
        """The default process group of this role's ranks (the planner's simulated rank joins a fake one instead)."""
        init_process_group(self.rank, self.world_size, master_addr, master_port, self.device)

    def _build_networks(self) -> dict[str, torch.nn.Module]:
        """The trained network and the frozen ones the hooks may name: `ref` (LoRA base or EMA weights, from
        --ref-mode), and what the role's declaration lists (shadow views; a checkpoint network when its path flag,
        e.g. --teacher-load, is given)."""
        networks: dict[str, torch.nn.Module] = {"policy": self.model}
        if self.args.ref_mode == "lora_base":
            networks["ref"] = LoraBaseNetwork(self.model)
        elif self.args.ref_mode == "ema":
            if self.ema is None:  # the parser refuses it; a hand-made args namespace may not
                raise ValueError(f"{self.role}: --ref-mode ema needs --use-ema (no EMA weights to serve as ref)")
            networks["ref"] = self.ema.network(self.model)
        for name, shadow in self.shadows.items():
            networks[name] = shadow.network(self.model)
        for frozen in self.frozen:
            # a checkpoint network names its path flag, a shadow none (FrozenNetwork checks it)
            path = getattr(self.args, frozen.path_flag, None) if frozen.path_flag is not None else None
            if path:
                self.loaded[frozen.name] = networks[frozen.name] = self._load_frozen(path)
        return networks

    def _load_frozen(self, path: str) -> torch.nn.Module:
        """A frozen network (eval, no grad, no optimizer), sharded with FSDP2 like the trained one. Held in the
        forward dtype: no optimizer steps on it, so fp32 master weights would only double its memory under bf16 (its
        forwards see the same bf16 values either way: FSDP2 casts fp32 shards to the forward dtype at all-gather)."""
        network = load_sharded(
            self.family,
            path,
            dtype=self.forward_dtype,
            device=self._home(),
            prepare=lambda network: self._split_sequence(network.requires_grad_(False)),
            shard=lambda network: apply_fsdp2(
                network,
                self.family.transformer_blocks(network),
                param_dtype=self.forward_dtype,
                reduce_dtype=parse_dtype(self.args.fsdp_reduce_dtype),
                cast_root_inputs=False,
                compile_mode=self.args.compile,
                split_blocks=True,  # frozen: gathered a block's child at a time
                **self._placement(),
            ),
        )
        return network.eval()

    def _prepare_trained(self, model: torch.nn.Module) -> None:
        """The trained network before sharding: the LoRA adapter, then its tokens split over the sequence-parallel
        group."""
        if self.lora_config is not None:
            apply_lora(model, self.lora_config)
        self._split_sequence(model)

    def _split_sequence(self, network: torch.nn.Module) -> torch.nn.Module:
        """`network` run under Ulysses sequence parallelism over this rank's group (as it is at --sp-size 1)."""
        if self.sp is not None:
            self.family.apply_sequence_parallel(network, self.sp)
        return network

    def _home(self) -> torch.device:
        """Where the shards live: with CPU offload the model never visits the GPU (FSDP2 pins the CPU shards)."""
        return torch.device("cpu") if self.args.fsdp_cpu_offload else self.device

    def _placement(self) -> dict[str, Any]:
        """Where the shards live: the (hybrid) mesh and CPU offload, the same for every network of the role."""
        if not hasattr(self, "mesh"):
            self.mesh = build_mesh(self.world_size, self.args.fsdp_shard_size, self.device.type)
        return {"mesh": self.mesh, "cpu_offload": self.args.fsdp_cpu_offload}

    def _sharded_state(self) -> dict[str, dict[str, torch.Tensor]]:
        state = {}
        if self.ema is not None:
            state["ema"] = self.ema.state_dict()
        for name, shadow in self.shadows.items():
            state[SHADOW_CHECKPOINT_KEYS.get(name, f"shadow_{name}")] = shadow.state_dict()
        return state

    def _load(self) -> int:
        load_dir = self.settings["load"]
        if not load_dir or read_latest(load_dir) is None:
            if load_dir:
                logger.info("no checkpoint in %s yet: starting from rollout 0", load_dir)
            return 0
        loaded = self._restore(load_dir, None, load_optimizer=not self.args.no_load_optim)
        self.global_step = int(loaded.meta.get("global_step", 0))
        logger.info("%s rank %d resumed from %s at rollout %d", self.role, self.rank, load_dir, loaded.rollout_id)
        return loaded.rollout_id + 1

    def _restore(self, load_dir: str, rollout_id: int | None, *, load_optimizer: bool) -> LoadedCheckpoint:
        return load_checkpoint(
            load_dir, self.role, model=self.model, optimizer=self.optimizer, lr_scheduler=self.lr_scheduler,
            rollout_id=rollout_id, load_optimizer=load_optimizer, sharded=self._sharded_state(),
            verify_checksums=not self.args.skip_checkpoint_checksums,
        )  # fmt: skip

    def rollback(self, rollout_id: int, lr_factor: float) -> None:
        """--monitor-action rollback (collective): this role's checkpoint of `rollout_id` in its save folder (weights,
        optimizer, LR schedule, EMA and shadows, RNG; the step count goes on), then its learning rate x `lr_factor`."""
        self.wake()
        self._restore(self.settings["save"], rollout_id, load_optimizer=True)
        scale_learning_rate(self.optimizer, self.lr_scheduler, lr_factor)

    # ---- sleep / wake (--colocate-sleep) -------------------------------------------------------
    def _resident_tensors(self) -> list[torch.Tensor]:
        """Every tensor this rank keeps between calls: the shards and buffers of its networks (the trained one and
        those loaded from a checkpoint, e.g. a teacher), the optimizer's state and the shadow / EMA weights."""
        modules = [self.model, *self.loaded.values()]
        tensors = []
        for module in modules:
            reshard(module)  # a forward-only pass leaves the root gathered: free that copy instead of moving it
            tensors += [local_tensor(t) for t in (*module.parameters(), *module.buffers())]
        for state in self.optimizer.state.values():
            tensors += [local_tensor(v) for v in state.values() if isinstance(v, torch.Tensor)]
        for shadow in [self.ema, *self.shadows.values()]:
            if shadow is not None:
                tensors += shadow.tensors()
        return tensors

    def sleep(self) -> dict[str, float]:
        """Move the rank's weights, optimizer state and shadows to host memory and free their device memory (the
        engines generate meanwhile); gradients are dropped (every window starts from none). Not collective."""
        self.optimizer.zero_grad(set_to_none=True)
        report = self.swap.sleep(self._resident_tensors())
        logger.debug("%s rank %d asleep: %s", self.role, self.rank, report.describe())
        return dataclasses.asdict(report)

    def wake(self) -> dict[str, float]:
        """Bring back what `sleep` moved, bit for bit (a no-op when awake). Every call that needs the weights wakes
        the rank first, so a missed wake costs memory, never results."""
        report = self.swap.wake()
        if report.storages:
            logger.debug("%s rank %d awake: %s", self.role, self.rank, report.describe())
        return dataclasses.asdict(report)

    def train(self, rollout_id: int, data: Any, peer: Any = None) -> Any:
        """`TrainLoop.train` on an awake rank."""
        self.wake()
        return super().train(rollout_id, data, peer)

    # ---- weights and checkpoints --------------------------------------------------------------
    def check_finite_weights(self, purpose: str) -> None:
        """Refuse, on every rank together, to write weights that are not finite (trained or shadow)."""
        self.wake()
        tensors = [*self.model.parameters(), *(t for s in self.shadows.values() for t in s.state_dict().values())]
        bad = any(not bool(torch.isfinite(t.to_local() if isinstance(t, DTensor) else t).all()) for t in tensors)
        flag = torch.tensor([float(bad)], device=collective_device())
        if self.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            raise RuntimeError(f"{self.role}: the weights hold NaN or inf values; refusing to {purpose}")

    def save(self, rollout_id: int, extra: dict | None = None) -> str:
        self.check_finite_weights(f"save rollout {rollout_id} to {self.settings['save']}")
        return save_checkpoint(
            self.settings["save"],
            rollout_id,
            self.role,
            model=self.model,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            extra=extra,
            meta={"global_step": self.global_step, **checkpoint_meta(self.args)},
            sharded=self._sharded_state(),
            save_flag=role_flag(self.role, "save"),  # what a full device's error names
        )

    @property
    def export(self) -> EngineExport:
        """What the engines sample with, as this rank sends it (`miles.backends.fsdp_utils.engine_export`)."""
        parts = (self.model, self.family, self.rank, self.forward_dtype, self.lora_config, self.hooks.engine_weights)
        return EngineExport(*parts, self.shadows, self.ema, self.args.ema_rollout_policy)

    def export_weights(self) -> tuple[dict[str, torch.Tensor] | None, dict[str, TensorChecksum] | None]:
        """(weights, their checksums) for the rollout engines on rank 0, (None, None) elsewhere; collective.

        The declared shadow the loss-hub entry names (`engine_weights`, e.g. NFT's old policy), else EMA weights with
        `--ema-rollout-policy ema`, else the live ones; only the LoRA entries with LoRA. Each engine verifies what it
        loaded against the checksums (`miles.utils.weight_checksum`), computed here on the device before the weights
        leave it.
        """
        self.wake()
        return self.export.weights()

    # ---- the weight sync (miles.weight_sync; the driver's side is miles.ray.weight_sync) -----------------------
    def prepare_weight_sync(
        self, kind: str, bucket_bytes: int, direct: bool = False, resident: bool = False
    ) -> tuple[SyncPlan, str | tuple | None, tuple[int, ...] | None]:
        """The bucket plan (every rank; collective), on rank 0 the shared transport's buffer, what the engines open
        it by and its layout (`WeightPusher.prepare`: `direct`, every rank writes its shards; `resident`)."""
        keep, as_dtype = self.export.filters()
        self.pusher = WeightPusher(sync_plan(self.model, bucket_bytes, keep, as_dtype), self.rank, self.device)
        return self.pusher.plan, self.pusher.prepare(kind, direct, resident), self.pusher.offsets

    def open_weight_sync(self, spec: TransportSpec) -> None:
        """Rank 0 joins the sync group with the engines (they join at the same time)."""
        self._pusher().open(spec)

    def _pusher(self) -> WeightPusher:
        if self.pusher is None:
            raise RuntimeError(f"{self.role}: the weight sync is used before prepare_weight_sync made its plan")
        return self.pusher

    def push_weights(self) -> float:
        """Gather the engines' weights (collective) and, on rank 0, send them bucket by bucket, each with its
        checksums; seconds on rank 0 until the engines took the last bucket."""
        self.wake()
        export = self.export
        keep, as_dtype = export.filters()
        with export.weights_in():
            return self._pusher().push(self.model, keep, as_dtype)

    def full_state_dict_every_rank(self) -> dict[str, torch.Tensor]:
        """Each rank's own gather of the full weights (to check that ranks agree)."""
        self.wake()
        return {k: v.detach().cpu() for k, v in full_state_dict(self.model, cpu_offload=False).items()}

    def network_state_dict_every_rank(self, name: str) -> dict[str, torch.Tensor]:
        """Each rank's gather of a named network's full weights (`policy`, `teacher`, ...; tests and tools)."""
        self.wake()
        network = self.networks[name]
        return {k: v.detach().cpu() for k, v in full_state_dict(network, cpu_offload=False).items()}

    def save_hf(self, out_dir: str) -> str | None:
        """A diffusers pipeline folder with the trained transformer, or a PEFT LoRA adapter folder with LoRA."""
        self.check_finite_weights(f"write --save-hf {out_dir}")
        return self.export.save_hf(out_dir)

    def shutdown(self) -> None:
        if self.prefetcher is not None:  # None until init built it
            self.prefetcher.shutdown()
        if self.pusher is not None:
            self.pusher.close()
            self.pusher = None
        destroy_process_group()
