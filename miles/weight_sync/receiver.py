"""The engine's end of the weight sync: each bucket, as it arrives, is copied into the parameters in place and its
tensors' checksums (`weight_checksum.block_terms`) are verified over what was loaded (over what arrived where the
engine holds another dtype). Over a resident `shm` sync the engine's tensors are views of the shared file
(`bind_resident`): the trainer writes them, nothing is copied, and the engines of the host split the verification
of the one copy they share (each also checks that its tensors still are those views)."""

from __future__ import annotations

import logging

import torch

from miles.utils.weight_checksum import WeightSyncError, block_terms
from miles.weight_sync.protocol import BucketMeta, SyncPlan, split_by_bytes
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
def bind_resident(transport: Transport, plan: SyncPlan, targets: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Resident `shm`: make each of this engine's tensors that the sync carries in its own dtype a view of its place
    in the shared file (the first engine copies its current values there first, so the engines sample with them
    until the first sync); {name: view} of those bound. The others (held in another dtype) are copied at each
    sync. Call before any engine samples (the engines open the sync together, before the first rollout)."""
    if not transport.resident:
        return {}
    bound: dict[str, torch.Tensor] = {}
    tied: set[int] = set()
    for bucket in plan.buckets:
        data = transport.view(bucket)
        for slot in bucket.tensors:
            target, view = targets[slot.name], slot.view(data)
            if target.dtype != view.dtype or target.device != view.device or id(target) in tied:
                continue  # copied at each sync (a tensor under a second name: into its first name's view)
            tied.add(id(target))
            if transport.rank == 1:
                view.copy_(target)
            target.data = view
            bound[slot.name] = view
    return bound


@torch.no_grad()
def unbind(bound: dict[str, torch.Tensor], targets: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Give this engine's tensors bound by `bind_resident` a private copy each (a load of its own must not change the
    other engines' weights, nor a later sync's copies go to a file other engines still map); {} to keep as bound."""
    for name, view in bound.items():
        target = targets.get(name)  # a reused engine may hold another transformer by now
        if target is not None and target.data_ptr() == view.data_ptr():
            target.data = view.clone()
    return {}


def _check_bound(bound: dict[str, torch.Tensor], targets: dict[str, torch.Tensor], version: int) -> None:
    moved = [n for n, view in bound.items() if targets[n].data_ptr() != view.data_ptr()]
    if moved:
        raise WeightSyncError(
            f"weights version {version}: {len(moved)} of this engine's tensors no longer are views of the shared "
            f"weights, e.g. {moved[:3]}: something replaced their storage after the weight sync bound them"
        )


@torch.no_grad()
def receive_into(
    transport: Transport,
    plan: SyncPlan,
    targets: dict[str, torch.Tensor],
    version: int,
    bound: dict[str, torch.Tensor] | None = None,
) -> None:
    """Receive every bucket of one sync, copying each tensor into `targets[name]` in place (cast where the engine
    holds another dtype), and verify each bucket's checksums. A mismatch does not stop the sync (the trainer would
    wait for this engine): the first is raised once every bucket is taken, as a `WeightSyncError` naming the tensor.
    `bound` (`bind_resident`): tensors the trainer writes in place, nothing to copy; this engine verifies its share
    of them (`split_by_bytes` over the engines), the engines of the host together all of them."""
    bound = bound or {}
    _check_bound(bound, targets, version)
    engines = transport.spec.world_size - 1
    owners = split_by_bytes(plan, engines) if bound else []
    failures: list[str] = []
    transport.begin()
    for bucket in plan.buckets:
        data, terms = transport.receive(bucket)
        checked, rows = [], []
        for i, slot in enumerate(bucket.tensors):
            if slot.name in bound:
                if owners[bucket.index][i] == transport.rank - 1:
                    checked.append(block_terms(bound[slot.name]))
                    rows.append(i)
                continue
            source, target = slot.view(data), targets[slot.name]
            target.copy_(source)
            # as loaded (transit and load), or as received where a cast changes the bits by design (a LoRA adapter
            # sent as trained and held in the forward dtype)
            checked.append(block_terms(target if target.dtype == source.dtype else source))
            rows.append(i)
        failure = _compare(bucket, rows, checked, terms, version)
        if failure:
            failures.append(failure)
        transport.release(bucket)
    if failures:
        more = f" ({len(failures)} of {len(plan.buckets)} buckets differ)" if len(failures) > 1 else ""
        raise WeightSyncError(
            f"{failures[0]}{more}: the weights were changed between the trainer's export and the engine's load"
        )


def _compare(
    bucket: BucketMeta, rows: list[int], checked: list[torch.Tensor], terms: torch.Tensor, version: int
) -> str | None:
    """What differs in one bucket between the trainer's terms and this engine's (of tensors `rows`), or None."""
    if not rows:
        return None
    got = torch.stack(checked).cpu()
    bad = [i for k, i in enumerate(rows) if not torch.equal(got[k], terms[i])]
    if not bad:
        return None
    first, k = bucket.tensors[bad[0]].name, rows.index(bad[0])
    return (
        f"weights version {version}: {len(bad)} of {len(bucket.tensors)} tensors of bucket {bucket.index} "
        f"differ from what the trainer sent, first {first!r} (trainer {tuple(terms[bad[0]].tolist())}, "
        f"engine {tuple(got[k].tolist())})"
        + (f", also {[bucket.tensors[i].name for i in bad[1:4]]}" if len(bad) > 1 else "")
    )


def drain(transport: Transport, plan: SyncPlan) -> None:
    """Take every bucket of one sync without loading it (a stale version: the trainer still sends the whole sync;
    resident, it writes the shared parameters all the same)."""
    transport.begin()
    for bucket in plan.buckets:
        transport.receive(bucket)
        transport.release(bucket)
