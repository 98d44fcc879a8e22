"""The weight gather's bucket plan (`gather.gather_plan`) is the same on every rank: hand-written entries; the real
configs of every family on the meta device at world sizes 2..64 (pure, against torch.chunk's split and the old rule);
FSDP2's DTensors on fake process groups (what each rank reads); gloo ranks gathering rows that do not divide the
shard group."""

from __future__ import annotations

import functools
import inspect
import itertools
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from diffusers import (
    FluxTransformer2DModel,
    LTX2VideoTransformer3DModel,
    QwenImageTransformer2DModel,
    SD3Transformer2DModel,
    WanTransformer3DModel,
)
from peft import LoraConfig, inject_adapter_in_model
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from miles.backends.fsdp_utils.fsdp import build_mesh
from miles.backends.fsdp_utils.gather import GATHER_BUCKET_BYTES, GatherEntry, ShardLayout, gather_entries, gather_plan
from miles.models.flux.flux import FluxPipelineConfig
from miles.models.ltx2.ltx2 import LTX2PipelineConfig
from miles.models.qwen.qwen_image import QwenImagePipelineConfig
from miles.models.sd3.sd3 import SD3PipelineConfig
from miles.models.wan.experts import WanExperts
from miles.models.wan.wan import WanPipelineConfig
from miles.utils.weight_checksum import block_terms
from tests.background import job_folder
from tests.fast.backends.fsdp_utils import rank_jobs
from tests.fast.backends.fsdp_utils.gather_plan_workers import SHARD, is_lora

F32, BF16 = torch.float32, torch.bfloat16
BUCKET_BYTES = (GATHER_BUCKET_BYTES["cpu"], GATHER_BUCKET_BYTES["cuda"])


# ---------------------------------------------------------------------------------------------------------------------
# Hand-written entries


def _layout(world: int, shard: int | None = None) -> ShardLayout:
    """The layout FSDP2 gives: its default 1-D mesh over the world, or `build_mesh`'s (replicate, shard) mesh."""
    if shard is None or shard == world:
        return ShardLayout((world,), tuple(range(world)), None, 0)
    return ShardLayout((world // shard, shard), tuple(range(world)), ("replicate", "shard"), 1)


def test_gather_plan_closes_buckets_at_the_padded_limit_and_at_layout_changes():
    three = _layout(3)
    entries = [
        GatherEntry("a", (1, 6, 8), F32, three),  # 1 row of 48 floats: 192 bytes from every rank, 2 of 3 send padding
        GatherEntry("b", (2, 8), F32, three),  # 32
        GatherEntry("c", (5, 8), F32, three),  # 2 rows: 64
        GatherEntry("buffer", (3,), F32, None),
        GatherEntry("d", (4, 8), F32, three),  # 64
        GatherEntry("e", (4, 8), BF16, three),  # 32: another dtype
        GatherEntry("f", (4, 8), BF16, _layout(6, 3)),  # another mesh, same group size
        GatherEntry("g", (7,), BF16, _layout(6, 3)),  # 6
    ]
    plan = gather_plan(entries, bucket_bytes=200)
    assert [(b.names, b.nbytes) for b in plan] == [
        (("a", "b"), 224),  # reached 200 after b: c starts the next bucket
        (("c",), 64),
        (("buffer",), 0),
        (("d",), 64),
        (("e",), 32),
        (("f", "g"), 38),
    ]
    assert [b.layout for b in plan] == [three, three, None, three, three, _layout(6, 3)]
    assert [b.names for b in gather_plan(entries, bucket_bytes=1)] == [(e.name,) for e in entries]


# ---------------------------------------------------------------------------------------------------------------------
# The real configs on the meta device

# Published transformer configs (config.json of each checkpoint), checked against the classes' __init__ below.
SD35_MEDIUM = {
    "sample_size": 128, "patch_size": 2, "in_channels": 16, "num_layers": 24, "attention_head_dim": 64,
    "num_attention_heads": 24, "joint_attention_dim": 4096, "caption_projection_dim": 1536,
    "pooled_projection_dim": 2048, "out_channels": 16, "pos_embed_max_size": 384,
    "dual_attention_layers": tuple(range(13)), "qk_norm": "rms_norm",
}  # fmt: skip
SD35_LARGE = {
    "sample_size": 128, "patch_size": 2, "in_channels": 16, "num_layers": 38, "attention_head_dim": 64,
    "num_attention_heads": 38, "joint_attention_dim": 4096, "caption_projection_dim": 2432,
    "pooled_projection_dim": 2048, "out_channels": 16, "pos_embed_max_size": 192, "dual_attention_layers": (),
    "qk_norm": "rms_norm",
}  # fmt: skip
FLUX1_DEV = {
    "patch_size": 1, "in_channels": 64, "num_layers": 19, "num_single_layers": 38, "attention_head_dim": 128,
    "num_attention_heads": 24, "joint_attention_dim": 4096, "pooled_projection_dim": 768, "guidance_embeds": True,
    "axes_dims_rope": (16, 56, 56),
}  # fmt: skip
QWEN_IMAGE = {
    "patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 60, "attention_head_dim": 128,
    "num_attention_heads": 24, "joint_attention_dim": 3584, "guidance_embeds": False, "axes_dims_rope": (16, 56, 56),
}  # fmt: skip
WAN21_1_3B = {
    "patch_size": (1, 2, 2), "num_attention_heads": 12, "attention_head_dim": 128, "in_channels": 16,
    "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 8960, "num_layers": 30, "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "image_dim": None, "added_kv_proj_dim": None,
    "rope_max_seq_len": 1024,
}  # fmt: skip
WAN21_14B = {**WAN21_1_3B, "num_attention_heads": 40, "ffn_dim": 13824, "num_layers": 40}
# LTX-2: the class defaults (48 blocks, video 32 x 128, audio 32 x 64 heads, Gemma features of 3840: 18.9B parameters,
# the released 19B model's sizes); its config.json could not be read offline to confirm every field.
LTX2 = {}


@dataclass(frozen=True)
class Case:
    family: type  # the miles family: its LoRA targets and FSDP2 blocks
    transformer: type
    config: dict
    expert: str | None = None  # Wan 2.2 A14B: two experts of this case in one WanExperts


CASES = {
    "sd3.5-medium": Case(SD3PipelineConfig, SD3Transformer2DModel, SD35_MEDIUM),
    "sd3.5-large": Case(SD3PipelineConfig, SD3Transformer2DModel, SD35_LARGE),
    "flux.1-dev": Case(FluxPipelineConfig, FluxTransformer2DModel, FLUX1_DEV),
    "qwen-image": Case(QwenImagePipelineConfig, QwenImageTransformer2DModel, QWEN_IMAGE),
    "wan2.1-1.3b": Case(WanPipelineConfig, WanTransformer3DModel, WAN21_1_3B),
    "wan2.1-14b": Case(WanPipelineConfig, WanTransformer3DModel, WAN21_14B),
    "wan2.2-a14b": Case(WanPipelineConfig, WanTransformer3DModel, WAN21_14B, expert="wan2.1-14b"),
    "ltx-2": Case(LTX2PipelineConfig, LTX2VideoTransformer3DModel, LTX2),
}
PLAIN_WORLDS = (2, 3, 5, 6, 7, 8, 13, 16, 24, 31, 48, 64)  # primes, and the usual sizes
HYBRID_WORLDS = ((6, 3), (64, 8))  # (world, shard size)
LAYOUTS = [_layout(world) for world in PLAIN_WORLDS] + [_layout(world, shard) for world, shard in HYBRID_WORLDS]
LORA_RANKS = (0, 4, 64)  # none, rank < dp, rank not dividing dp


@pytest.mark.parametrize("name", CASES)
def test_family_configs_name_real_init_arguments(name):
    case = CASES[name]
    accepted = inspect.signature(case.transformer.__init__).parameters
    assert set(case.config) <= set(accepted), sorted(set(case.config) - set(accepted))


def build_meta(case: Case, lora_rank: int = 0) -> nn.Module:
    """The family's transformer on the meta device (no memory), with a peft LoRA adapter on the family's default
    targets as `apply_lora` injects it (`lora_alpha` = rank)."""
    if case.expert is not None:  # one module as both experts: the state dict lists it under both names, as two would
        expert = meta_model(case.expert, lora_rank)
        return WanExperts(expert, expert, boundary_timestep=875.0)
    with torch.device("meta"):
        model = case.transformer.from_config(case.config)
    if lora_rank:
        config = LoraConfig(r=lora_rank, lora_alpha=lora_rank, target_modules=list(case.family.default_lora_targets))
        inject_adapter_in_model(config, model)
    return model


@functools.cache
def meta_model(name: str, lora_rank: int) -> nn.Module:
    """`build_meta` once per case (Wan 2.2's experts reuse Wan 2.1 14B's)."""
    return build_meta(CASES[name], lora_rank)


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]
    lora: bool
    parameter: bool  # FSDP2 shards parameters along dim 0; buffers stay whole


@functools.cache
def meta_tensors(name: str, lora_rank: int) -> tuple[Tensor, ...]:
    """A case's state dict, read once: LoRA rank 4 injected by peft; rank 64 is rank 4 with the rank dim widened (A
    is (r, in), B is (out, r); `test_lora_rank_64_entries_are_peft_ones` checks it on Wan 1.3B), as a second
    injection into a real-size model costs seconds."""
    if lora_rank == 64:
        return tuple(_widen(t, 4, 64) for t in meta_tensors(name, 4))
    model = meta_model(name, lora_rank)
    parameters = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    return tuple(
        Tensor(key, tuple(value.shape), is_lora(key), key in parameters) for key, value in model.state_dict().items()
    )


def _widen(tensor: Tensor, old: int, new: int) -> Tensor:
    if ".lora_A." in tensor.name:
        assert tensor.shape[0] == old
        return Tensor(tensor.name, (new, *tensor.shape[1:]), True, tensor.parameter)
    if ".lora_B." in tensor.name:
        assert tensor.shape[1] == old
        return Tensor(tensor.name, (tensor.shape[0], new), True, tensor.parameter)
    return tensor


def test_lora_rank_64_entries_are_peft_ones():
    peft = build_meta(CASES["wan2.1-1.3b"], lora_rank=64).state_dict()
    widened = meta_tensors("wan2.1-1.3b", 64)
    assert [(t.name, t.shape) for t in widened] == [(k, tuple(v.shape)) for k, v in peft.items()]


def meta_entries(tensors: tuple[Tensor, ...], layout: ShardLayout, master: torch.dtype) -> list[GatherEntry]:
    """What `gather_entries` reads on any rank of an FSDP2 model with these tensors (the fake-process-group test
    below checks it on the DTensors): parameters in the master dtype (LoRA in float32, as `apply_lora` keeps it)
    sharded on `layout`, buffers whole."""
    return [GatherEntry(t.name, t.shape, F32 if t.lora else master, layout if t.parameter else None) for t in tensors]


@functools.cache
def chunk_rows(rows: int, group: int) -> tuple[int, ...]:
    """Rows of each rank's shard: torch.chunk's split, which FSDP2 uses (ranks past the last chunk hold none)."""
    sizes = [len(c) for c in torch.arange(rows).chunk(group)]
    return tuple(sizes + [0] * (group - len(sizes)))


@functools.cache
def sent_bytes(shape: tuple[int, ...], dtype: torch.dtype, group: int) -> int:
    """Bytes every rank puts in the all-gather for this tensor: its shard padded to the largest shard of the group."""
    return max(chunk_rows(shape[0], group)) * math.prod(shape[1:]) * dtype.itemsize


@functools.cache
def own_bytes(shape: tuple[int, ...], dtype: torch.dtype, group: int, coordinate: int) -> int:
    """Bytes of the shard the rank at `coordinate` of its group holds: what the old rule counted."""
    return chunk_rows(shape[0], group)[coordinate] * math.prod(shape[1:]) * dtype.itemsize


def old_plan(entries: list[GatherEntry], coordinate: int, bucket_bytes: int) -> list[tuple[str, ...]]:
    """The old rule on the rank at `coordinate` of its shard group: a bucket closes once the rank's own (unpadded)
    shard bytes reach the limit (and, as now, at a change of dtype or layout)."""
    plan, bucket, key, size = [], [], None, 0
    for entry in entries:
        if entry.layout is None:
            plan += [tuple(bucket), (entry.name,)] if bucket else [(entry.name,)]
            bucket, size = [], 0
            continue
        if (entry.dtype, entry.layout) != key or size >= bucket_bytes:
            plan += [tuple(bucket)] if bucket else []
            bucket, size, key = [], 0, (entry.dtype, entry.layout)
        bucket.append(entry.name)
        size += own_bytes(entry.shape, entry.dtype, entry.layout.group_size, coordinate)
    return plan + [tuple(bucket)] if bucket else plan


@pytest.mark.parametrize("name", CASES)
def test_every_rank_plans_the_same_buckets_and_sends_their_bytes(name):
    """At each world size (plain and hybrid sharding), master dtype, LoRA rank and bucket size the plan is one
    function of the entries every rank reads alike; its byte count per bucket is what each rank sends (torch.chunk's
    largest shard, padded to), tensors with fewer rows than ranks included; a bucket closes only at the limit or
    where dtype or layout change. The old rule cuts the first and the last rank of a group differently somewhere in
    this sweep for every family (at 4 MiB buckets: at 7, 13 or 31 ranks for most), so the old code fails there."""
    fewer_rows_than_ranks, old_rule_diverged = 0, None
    for lora_rank in LORA_RANKS:
        tensors = meta_tensors(name, lora_rank)
        assert any(t.lora for t in tensors) == bool(lora_rank)
        for layout, master in itertools.product(LAYOUTS, (F32, BF16)):
            entries = meta_entries(tensors, layout, master)
            group = layout.group_size
            sent = [sent_bytes(e.shape, e.dtype, group) if e.layout is not None else 0 for e in entries]
            before = [0, *itertools.accumulate(sent)]  # bytes sent for the entries before index i
            keys = [(e.dtype, e.layout) if e.layout is not None else i for i, e in enumerate(entries)]
            changes = {i for i in range(1, len(keys)) if keys[i] != keys[i - 1]}
            fewer_rows_than_ranks += sum(e.layout is not None and e.shape[0] < group for e in entries)
            for bucket_bytes in BUCKET_BYTES:
                plan = gather_plan(entries, bucket_bytes)
                assert [n for b in plan for n in b.names] == [e.name for e in entries]
                starts = [0, *itertools.accumulate(len(b.names) for b in plan)]
                assert changes <= set(starts)  # a bucket holds one dtype and layout
                for bucket, begin, end in zip(plan, starts, starts[1:]):
                    if bucket.layout is None:
                        assert end - begin == 1 and entries[begin].layout is None and bucket.nbytes == 0
                        continue
                    assert bucket.layout == layout and bucket.nbytes == before[end] - before[begin]
                    assert bucket.nbytes - sent[end - 1] < bucket_bytes  # closed once it reached the limit
                    assert bucket.nbytes >= bucket_bytes or end == len(entries) or end in changes
            if old_rule_diverged is None:  # the first case found is enough
                first = old_plan(entries, 0, GATHER_BUCKET_BYTES["cpu"])
                if first != old_plan(entries, group - 1, GATHER_BUCKET_BYTES["cpu"]):
                    old_rule_diverged = (lora_rank, layout.shape, master)
    assert fewer_rows_than_ranks > 0
    assert old_rule_diverged is not None


# ---------------------------------------------------------------------------------------------------------------------
# FSDP2's DTensors, one fake process group per rank


@contextmanager
def fake_rank(rank: int, world: int) -> Iterator[None]:
    """A default process group of `world` ranks in which this process is `rank`; collectives do nothing."""
    if dist.is_initialized():
        raise RuntimeError("a default process group is already up in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def fsdp2_view(world: int, shard: int | None, rank: int) -> dict:
    """What one rank of Wan 2.1 1.3B with LoRA rank 4 holds under FSDP2 (`fully_shard` per block, then the root, on
    FSDP2's default mesh or `build_mesh`'s): the plan's inputs and its shards' rows, read off the real DTensors."""
    case = CASES["wan2.1-1.3b"]
    with fake_rank(rank, world):
        model = build_meta(case, lora_rank=4)
        mesh = build_mesh(world, shard, "cpu")
        for block in object.__new__(case.family).transformer_blocks(model):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        state = model.state_dict()
        return {
            "entries": gather_entries(state),
            "rows": {n: v.to_local().shape[0] for n, v in state.items() if isinstance(v, DTensor)},
        }


# (world, shard size, rank, its rows of the (1, 6, D) table and of a (4, D) LoRA A): under plain FSDP2 the last rank
# (the smallest shards, many empty); under hybrid sharding the second of the second replica
FAKE_RANKS = ((16, None, 15, (0, 0)), (16, 8, 9, (0, 1)))


@pytest.mark.parametrize(("world", "shard", "rank", "held"), FAKE_RANKS)
def test_fsdp2_ranks_read_the_meta_plan_inputs_from_uneven_shards(world, shard, rank, held):
    """The rank reads off its DTensors the entries the meta-device test plans over (as rank 0 would: global metadata
    only), though it holds its own rows of each tensor, torch.chunk's split."""
    layout = _layout(world, shard)
    entries = meta_entries(meta_tensors("wan2.1-1.3b", 4), layout, F32)
    view = fsdp2_view(world, shard, rank)
    assert view["entries"] == entries
    coordinate = rank % layout.group_size  # build_mesh's: ranks [i*N, (i+1)*N) shard one copy
    for entry in entries:
        if entry.layout is not None:
            assert view["rows"][entry.name] == chunk_rows(entry.shape[0], layout.group_size)[coordinate], entry.name
    assert (view["rows"]["scale_shift_table"], view["rows"]["blocks.0.attn1.to_q.lora_A.default.weight"]) == held


# ---------------------------------------------------------------------------------------------------------------------
# gloo ranks


GLOO_JOB = "gather-ws6-shard3"
ON_GLOO = pytest.mark.background(rank_jobs.SCRIPT, GLOO_JOB)  # the tests that read its reports start the job


@pytest.fixture(scope="module")
def gloo_reports() -> dict[str, list[dict]]:
    """What each rank of a 6-rank run in 2 replicas of 3 shards reported (`gather_report`): its shard groups hold the
    uneven rows a plain 3-rank run would, so one run covers both (a separate 3-rank run cost ~25 s more). Before the
    plan, this run aborted in gloo ("Received data size doesn't match expected size", 612 vs 112 bytes). The run is
    the background job `gather-ws6-shard3` of rank_jobs.py (`gather_hybrid` on 2 x SHARD ranks)."""
    assert rank_jobs.JOBS[GLOO_JOB][1:3] == ("gather_hybrid", 2 * SHARD)
    return {"ws6-shard3": rank_jobs.reports(job_folder(rank_jobs.SCRIPT, GLOO_JOB), GLOO_JOB)}


@ON_GLOO
@pytest.mark.parametrize("run", ["ws6-shard3"])
def test_bucketed_gather_of_odd_rows_equals_full_tensor(gloo_reports, run):
    """At every bucket size, rank 0 gets each tensor bit for bit as `full_tensor()` gathers it alone; others `{}`."""
    reports = gloo_reports[run]
    rank0 = reports[0]
    for rank, report in enumerate(reports):
        for size, got in report["bucketed"].items():
            if rank > 0:
                assert got == {}
                continue
            assert list(got) == list(rank0["per_tensor"]), size
            for name, expected in rank0["per_tensor"].items():
                assert got[name].dtype == expected.dtype and torch.equal(got[name], expected), (size, name)


@ON_GLOO
@pytest.mark.parametrize("run", ["ws6-shard3"])
def test_ranks_plan_alike_and_send_the_planned_bytes(gloo_reports, run):
    """The odd tables straddle bucket ends at these sizes; the ranks of a group hold different rows of them yet plan
    the same buckets and send, per all-gather, the bucket's planned bytes (a per-tensor gather would record -1); the
    old loop would have cut them differently."""
    reports = gloo_reports[run]
    assert len({tuple(sorted(r["local_rows"].items())) for r in reports[:SHARD]}) == SHARD  # 3 different shardings
    for report in reports:
        assert report["plans"] == reports[0]["plans"]
        for size, plan in report["plans"].items():
            assert report["sent"][size] == [nbytes for _, nbytes in plan if nbytes > 0], size
    splits = {size: [names for names, _ in plan] for size, plan in reports[0]["plans"].items()}
    assert len(splits[1]) == len(reports[0]["per_tensor"])  # one step per tensor (the buffer's costs no collective)
    assert len(splits[1 << 30]) == 2  # the buffer (first: the root's own), then every shard
    # (1, 6, 8) and (2, 8) fp32 tables: 1 and 1 padded rows of 192 and 32 bytes; 224 >= 200 closes the bucket
    assert splits[200][1] == ("blocks.0.scale_shift_table", "blocks.0.table") and reports[0]["sent"][200][0] == 224
    old = [report["old_plans"] for report in reports[:SHARD]]
    assert any(old[0][size] != other[size] for other in old[1:] for size in old[0])


@ON_GLOO
@pytest.mark.parametrize("run", ["ws6-shard3"])
def test_name_filter_gathers_only_kept_tensors(gloo_reports, run):
    """`keep` gathers the LoRA tensors only: one all-gather per 100-byte bucket, A (4, 8) and B (8, 4) of a block
    padded to 2 and 3 rows (64 + 48 bytes), nothing for the other tensors; on rank 0, or on every rank without
    `cpu_offload`."""
    reports = gloo_reports[run]
    lora = {n: t for n, t in reports[0]["per_tensor"].items() if is_lora(n)}
    assert len(lora) == 6
    for rank, report in enumerate(reports):
        assert report["lora_plan"] == [(f"blocks.{i}.lora_A.weight", f"blocks.{i}.lora_B.weight") for i in range(3)]
        assert report["lora_sent"] == [112, 112, 112]
        assert list(report["lora_every_rank"]) == list(lora)
        assert all(torch.equal(report["lora_every_rank"][name], expected) for name, expected in lora.items())
        if rank > 0:
            assert report["lora"] == {} and report["lora_full_state_dict"] == {}
            continue
        for got in (report["lora"], report["lora_full_state_dict"]):
            assert list(got) == list(lora)
            assert all(torch.equal(got[name], expected) for name, expected in lora.items())


@ON_GLOO
@pytest.mark.parametrize("run", ["ws6-shard3"])
def test_gather_in_the_engines_dtype_casts_before_it_sends(gloo_reports, run):
    """`as_dtype` (the weight export's: bf16 but the LoRA tensors): rank 0 receives each tensor as `full_tensor()`
    cast to that dtype, bit for bit, and every rank sends the bytes of the cast shards (half for the bf16 ones)."""
    reports = gloo_reports[run]
    expected = {n: t if is_lora(n) else t.to(torch.bfloat16) for n, t in reports[0]["per_tensor"].items()}
    got = reports[0]["bf16"]
    assert list(got) == list(expected)
    for name, value in expected.items():
        assert got[name].dtype == value.dtype and torch.equal(got[name], value), name
    fp32_bytes = [b for b in reports[0]["sent"][100] if b > 0]  # the same 100-byte buckets, as stored
    bf16_bytes = [b for b in reports[0]["bf16_sent"] if b > 0]
    assert sum(bf16_bytes) < sum(fp32_bytes)
    assert all(report["bf16_sent"] == reports[0]["bf16_sent"] for report in reports)  # the same collectives


@ON_GLOO
@pytest.mark.parametrize("run", ["ws6-shard3"])
def test_ranks_writing_their_own_rows_into_the_shared_buckets_give_the_full_tensors(gloo_reports, run):
    """The weight sync on one host (`WeightPusher.push_direct`): every rank of replica 0 writes its uneven dim-0 rows
    of each tensor, cast to the engines' dtype, where they lie in the bucket, rank 0 the buffer; what each of two
    syncs hands over (through two reused slots, then two resident: the whole sync in the file) is `full_tensor()`
    cast, bit for bit, with its `block_terms`."""
    reports = gloo_reports[run]
    expected = {n: t if is_lora(n) else t.to(torch.bfloat16) for n, t in reports[0]["per_tensor"].items()}
    assert all(report["direct"] is None for report in reports[1:]) and len(reports[0]["direct"]) == 4
    for sent in reports[0]["direct"]:
        assert list(sent) == list(expected)
        for name, value in expected.items():
            got, terms = sent[name]
            assert got.dtype == value.dtype and torch.equal(got, value), name
            assert torch.equal(terms, block_terms(value)), name
