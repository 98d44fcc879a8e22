"""The engine's end of the weight sync: each bucket, as it arrives, is copied into the parameters in place and its
tensors' checksums (`weight_checksum.block_terms`) are verified over what was loaded (over what arrived where the
engine holds another dtype)."""

from __future__ import annotations

import logging

import torch

from miles.utils.weight_checksum import WeightSyncError, block_terms
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
    failures: list[str] = []
    for bucket in plan.buckets:
        data, terms = transport.receive(bucket)
        checked = []
        for slot in bucket.tensors:
            source, target = slot.view(data), targets[slot.name]
            target.copy_(source)
            # as loaded (transit and load), or as received where a cast changes the bits by design (a LoRA adapter
            # sent as trained and held in the forward dtype)
            checked.append(block_terms(target if target.dtype == source.dtype else source))
        got = torch.stack(checked).cpu()
        bad = [i for i in range(len(bucket.tensors)) if not torch.equal(got[i], terms[i])]
        if bad:
            first = bucket.tensors[bad[0]].name
            failures.append(
                f"weights version {version}: {len(bad)} of {len(bucket.tensors)} tensors of bucket {bucket.index} "
                f"differ from what the trainer sent, first {first!r} (trainer {tuple(terms[bad[0]].tolist())}, "
                f"engine {tuple(got[bad[0]].tolist())})"
                + (f", also {[bucket.tensors[i].name for i in bad[1:4]]}" if len(bad) > 1 else "")
            )
        transport.release(bucket)
    if failures:
        more = f" ({len(failures)} of {len(plan.buckets)} buckets differ)" if len(failures) > 1 else ""
        raise WeightSyncError(
            f"{failures[0]}{more}: the weights were changed between the trainer's export and the engine's load"
        )


def drain(transport: Transport, plan: SyncPlan) -> None:
    """Take every bucket of one sync without loading it (a stale version: the trainer still sends the whole sync)."""
    for bucket in plan.buckets:
        transport.receive(bucket)
        transport.release(bucket)
