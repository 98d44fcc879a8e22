"""The engine's end of the weight sync: each bucket, as it arrives, is copied into the parameters in place and its
tensors' checksums are verified over what was loaded (over what arrived where the engine holds another dtype)."""

from __future__ import annotations

import logging

import torch

from miles.utils.weight_checksum import WeightSyncError, verify_loaded
from miles.weight_sync.protocol import SyncPlan
from miles.weight_sync.transports import Transport

logger = logging.getLogger(__name__)


def check_plan(plan: SyncPlan, targets: dict[str, torch.Tensor], *, complete: bool) -> None:
    """Refuse a plan that does not bind this engine's tensors: a name it has no tensor for, another shape, or (with
    `complete`: full fine-tuning) one of its tensors that no bucket carries (it would keep its old values)."""
    sent = {t.name: t for b in plan.buckets for t in b.tensors}
    unknown = sorted(set(sent) - set(targets))
    if unknown:
        raise WeightSyncError(
            f"the trainer sends {len(unknown)} tensors this engine has no tensor for, e.g. {unknown[:3]}: the trainer "
            "and the engines load different transformers (or LoRA targets)"
        )
    shapes = [n for n, t in sent.items() if tuple(targets[n].shape) != t.shape]
    if shapes:
        n = shapes[0]
        raise WeightSyncError(
            f"{n}: the trainer sends shape {sent[n].shape}, the engine holds {tuple(targets[n].shape)}"
        )
    missing = sorted(set(targets) - set(sent)) if complete else []
    if missing:
        raise WeightSyncError(f"the weight sync leaves {len(missing)} engine tensors unchanged, e.g. {missing[:3]}")


@torch.no_grad()
def receive_into(transport: Transport, plan: SyncPlan, targets: dict[str, torch.Tensor], version: int) -> None:
    """Receive every bucket of one sync, copying each tensor into `targets[name]` in place (cast where the engine
    holds another dtype), and verify each bucket's checksums. A mismatch does not stop the sync (the trainer would
    wait for this engine): the first is raised once every bucket is taken, as a `WeightSyncError` naming the tensor."""
    failures: list[WeightSyncError] = []
    for bucket in plan.buckets:
        data, terms = transport.receive(bucket)
        loaded, received = {}, {}
        for slot in bucket.tensors:
            source, target = slot.view(data), targets[slot.name]
            target.copy_(source)
            loaded[slot.name], received[slot.name] = target, source
        try:
            verify_loaded(bucket.checksums(terms), loaded, received, version=version)
        except WeightSyncError as exc:
            failures.append(exc)
        transport.release(bucket)
    if failures:
        more = f" ({len(failures)} buckets of {len(plan.buckets)} differ)" if len(failures) > 1 else ""
        raise WeightSyncError(f"{failures[0]}{more}")


def drain(transport: Transport, plan: SyncPlan) -> None:
    """Take every bucket of one sync without loading it (a stale version: the trainer still sends the whole sync)."""
    for bucket in plan.buckets:
        transport.receive(bucket)
        transport.release(bucket)
