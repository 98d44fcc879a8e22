"""The engine's end of the weight sync: each bucket, as it arrives, is copied into the parameters in place and its
tensors' checksums (`weight_checksum.block_terms`) are verified over what was loaded (over what arrived where the
engine holds another dtype)."""

from __future__ import annotations

import logging

import torch

from miles.utils.weight_checksum import BLOCK_WORDS, WeightSyncError, block_terms
from miles.weight_sync.protocol import SyncPlan
from miles.weight_sync.transports import Transport

logger = logging.getLogger(__name__)

BLOCK_BYTES = BLOCK_WORDS * 8
# `copy_and_terms` copies a tensor in chunks of this size and sums each while it is still in the core's cache (the
# L2 of a server core is 1-2 MiB): the verification then costs a few percent of the copy instead of one more read of
# the tensor from memory (docs/user-guide/performance.md, "The weight sync")
CHUNK_BYTES = 1 << 20


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
            checked.append(copy_and_terms(targets[slot.name], slot.view(data)))
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


def copy_and_terms(target: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """`target.copy_(source)`, and `block_terms` of the target as loaded (transit and load), or of the source where a
    cast changes the bits by design (a LoRA adapter sent as trained and held in the forward dtype). A contiguous CPU
    target of the source's dtype is copied chunk by chunk, each chunk's block sums taken right after its copy."""
    nbytes = target.numel() * target.element_size()
    same = target.dtype == source.dtype
    if not same or target.device.type != "cpu" or not target.is_contiguous() or nbytes < 2 * CHUNK_BYTES:
        target.copy_(source)
        return block_terms(target if same else source)
    into, raw = target.view(-1).view(torch.uint8), source.reshape(-1).view(torch.uint8)
    if into.data_ptr() % 8:  # not viewable as 64-bit words
        target.copy_(source)
        return block_terms(target)
    blocks = nbytes // BLOCK_BYTES
    whole, words_end = blocks * BLOCK_BYTES, nbytes // 8 * 8
    sums = torch.empty(blocks + 2, dtype=torch.int64)  # the blocks, then the last words and bytes (`block_terms`)
    for start in range(0, whole, CHUNK_BYTES):
        end = min(start + CHUNK_BYTES, whole)
        into[start:end].copy_(raw[start:end])
        words = into[start:end].view(torch.int64).view(-1, BLOCK_WORDS)
        torch.sum(words, dim=1, out=sums[start // BLOCK_BYTES : end // BLOCK_BYTES])
    into[whole:].copy_(raw[whole:])
    sums[blocks] = into[whole:words_end].view(torch.int64).sum()
    sums[blocks + 1] = into[words_end:].to(torch.int64).sum()
    weights = torch.arange(1, blocks + 3, dtype=torch.int64)
    return torch.stack([sums.sum(), (sums * weights).sum()])


def drain(transport: Transport, plan: SyncPlan) -> None:
    """Take every bucket of one sync without loading it (a stale version: the trainer still sends the whole sync)."""
    for bucket in plan.buckets:
        transport.receive(bucket)
        transport.release(bucket)
