"""Frozen GELU MLPs keep their (un-normalised) input for backward instead of their hidden activation and modulated
input (`frozen_mlp.py`): fewer saved bytes, the same outputs and gradients (`torch.equal`), in one process and on two
gloo ranks under FSDP2 with each block's children grouped apart (`split_blocks`, how a LoRA network is sharded),
there with the joint attention of `joint_attention.py` too, q / k / v projected again in backward (what
`apply_fsdp2` installs by default)."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from diffusers import SD3Transformer2DModel
from diffusers.models.attention import FeedForward
from torch.distributed.tensor import DTensor

from miles.backends.fsdp_utils.frozen_mlp import LEAN_MARK, lean_frozen_mlps
from miles.backends.fsdp_utils.fsdp import apply_fsdp2
from miles.backends.fsdp_utils.joint_attention import LeanJointAttnProcessor
from miles.backends.fsdp_utils.lora import apply_lora
from tests.fast.backends.fsdp_utils.fsdp_workers import run_ranks

TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
IMAGE_TOKENS, TEXT_TOKENS, WIDTH, BATCH = 64, 9, 64, 2


def sd3(lora: bool = True, **layout: Any) -> SD3Transformer2DModel:
    """A small SD3 transformer (2 joint blocks, 64 wide; the last block's text stream has no MLP), LoRA on attention;
    `layout`: SD3.5's `qk_norm` and `dual_attention_layers`."""
    torch.manual_seed(0)
    model = SD3Transformer2DModel(
        sample_size=16,
        patch_size=2,
        in_channels=16,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=4,
        joint_attention_dim=32,
        caption_projection_dim=WIDTH,
        pooled_projection_dim=32,
        out_channels=16,
        pos_embed_max_size=16,
        **layout,
    )
    if lora:
        config = {"r": 4, "lora_alpha": 4.0, "target_modules": TARGETS, "init_lora_weights": True}
        apply_lora(model, {**config, "lora_dropout": 0.0})
        with torch.no_grad():  # a trained adapter: B is not zero, so no gradient is
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(std=0.1)
    return model


def inputs(rank: int = 0, batch: int = BATCH) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1 + rank)
    return {
        "hidden_states": torch.randn(batch, 16, 16, 16, generator=gen),
        "timestep": torch.tensor([500.0, 300.0])[:batch],
        "encoder_hidden_states": torch.randn(batch, TEXT_TOKENS, 32, generator=gen),
        "pooled_projections": torch.randn(batch, 32, generator=gen),
    }


def step(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int, dict[str, Any]]:
    """One forward (the bytes its saved tensors hold, parameters and repeats not counted) and backward."""
    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]  # FSDP2: the shards
    params = {p.untyped_storage().data_ptr() for p in local}
    seen: set[int] = set()
    saved = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params | seen:
            seen.add(storage.data_ptr())
            saved += storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = model(**batch, return_dict=False)[0]
    out.square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), saved, grads


def test_a_lora_network_saves_each_mlp_input_instead_of_its_hidden_activation_with_equal_gradients():
    plain, lean = sd3(), sd3()
    assert lean_frozen_mlps(lean) == 3  # both blocks' image MLPs and the first block's text MLP
    assert lean_frozen_mlps(lean) == 0  # installed once
    out, saved, grads = step(plain, inputs())
    lean_out, lean_saved, lean_grads = step(lean, inputs())
    assert torch.equal(lean_out, out)
    assert grads.keys() == lean_grads.keys() and len(grads) == 2 * (8 + 7)  # A and B; block 1: no to_add_out
    for name, grad in grads.items():
        assert torch.equal(lean_grads[name], grad), name
    # every adapter gets a gradient but the last block's text query (its text outputs are dropped)
    assert sorted(n for n, g in grads.items() if not g.any()) == [
        f"transformer_blocks.1.attn.add_q_proj.lora_{ab}.default.weight" for ab in "AB"
    ]
    # each MLP keeps only the residual stream, which its norm kept anyway: not its GELU's input (width 256), its
    # modulated input (width 64), the norm's mean and rstd (2 a token) nor the modulation's `1 + scale` (one row a
    # sample); backward recomputes them (the joint blocks hand the MLPs the stream and its modulation)
    tokens = BATCH * (2 * IMAGE_TOKENS + TEXT_TOKENS)
    assert saved - lean_saved == tokens * (4 * WIDTH + 2) * 4 + 3 * BATCH * WIDTH * 4


def test_a_frozen_mlp_outside_sd3s_joint_blocks_keeps_its_input_with_equal_gradients():
    """An MLP called with its input (not the stream and a modulation, as FLUX's blocks call theirs): it keeps that
    input, not its GELU's, and its forward writes the GELU over its input's projection; the same numbers."""
    torch.manual_seed(0)
    plain = FeedForward(WIDTH, activation_fn="gelu-approximate").requires_grad_(False)
    lean = FeedForward(WIDTH, activation_fn="gelu-approximate").requires_grad_(False)
    lean.load_state_dict(plain.state_dict())
    assert lean_frozen_mlps(lean) == 1
    results = []
    for mlp in (plain, lean):
        x = torch.randn(BATCH, IMAGE_TOKENS, WIDTH, generator=torch.Generator().manual_seed(2), requires_grad=True)
        sizes: list[int] = []
        with torch.autograd.graph.saved_tensors_hooks(functools.partial(_numel_into, sizes), lambda t: t):
            out = mlp(x)
        out.square().sum().backward()
        results.append((out.detach(), x.grad, max(sizes)))
    (out, grad, largest), (lean_out, lean_grad, lean_largest) = results
    assert torch.equal(lean_out, out) and torch.equal(lean_grad, grad)
    assert (largest, lean_largest) == (BATCH * IMAGE_TOKENS * 4 * WIDTH, 4 * WIDTH * WIDTH)  # GELU input; a weight


def test_a_trained_or_gradient_free_mlp_runs_its_own_forward():
    """A fully trained MLP (its weights need its activations) and a no-grad forward: nothing changes."""
    plain, lean = sd3(lora=False), sd3(lora=False)
    lean_frozen_mlps(lean)
    out, saved, grads = step(plain, inputs())
    lean_out, lean_saved, lean_grads = step(lean, inputs())
    assert torch.equal(lean_out, out) and lean_saved == saved
    assert all(torch.equal(lean_grads[n], g) for n, g in grads.items())
    with torch.no_grad():
        assert torch.equal(lean(**inputs(), return_dict=False)[0], out)


def test_apply_fsdp2_installs_it_only_without_checkpointing(monkeypatch):
    installed: list[bool] = []
    monkeypatch.setattr("miles.backends.fsdp_utils.fsdp.lean_frozen_mlps", lambda block: installed.append(True))
    monkeypatch.setattr("miles.backends.fsdp_utils.fsdp.lean_joint_attention", lambda block: installed.append(True))
    monkeypatch.setattr("miles.backends.fsdp_utils.fsdp.checkpoint_activations", lambda block: None)
    monkeypatch.setattr("miles.backends.fsdp_utils.fsdp.compile_transformer", lambda *a: None)
    from miles.backends.fsdp_utils.fsdp import _prepare_blocks

    model = sd3(lora=False)
    for checkpointing, compile_mode, lean, expected in [
        (False, "off", True, 2 * 2),  # MLPs and attention of each block
        (True, "off", True, 0),
        (False, "blocks", True, 0),
        (False, "off", False, 0),
    ]:
        installed.clear()
        _prepare_blocks(model, list(model.transformer_blocks), checkpointing, compile_mode, lean)
        assert len(installed) == expected, (checkpointing, compile_mode, lean)


def _numel_into(sizes: list[int], tensor: torch.Tensor) -> torch.Tensor:
    sizes.append(tensor.numel())
    return tensor


def _gathered_into(held: list[str], model: torch.nn.Module, *_: Any) -> None:
    """A forward hook: the names of the parameters left gathered (not sharded DTensors) after the forward."""
    held.extend(n for n, p in model.named_parameters() if not isinstance(p, DTensor))


def lora_step_on_ranks(rank: int, world_size: int, out_dir: str) -> dict[str, Any]:
    """One LoRA forward and backward under FSDP2, with whole blocks as groups, with split blocks (each block's and
    the root's children groups of their own) and with split blocks and lean activations (MLPs and joint attention
    recomputing q / k / v), at a batch of one (where both save): full gradients, and the parameters left gathered
    between the forward and the backward."""
    report = {}
    for name, split, lean in (("blocks", False, False), ("split", True, False), ("lean", True, True)):
        model = sd3()
        blocks = list(model.transformer_blocks)
        dtypes = {"param_dtype": torch.float32, "reduce_dtype": torch.float32}
        apply_fsdp2(model, blocks, **dtypes, split_blocks=split, lean_activations=lean)
        mlps = sum(getattr(m, LEAN_MARK, False) for m in model.modules() if isinstance(m, FeedForward))
        processors = [getattr(m, "processor", None) for m in model.modules()]
        attentions = sum(type(p) is LeanJointAttnProcessor and p.recompute_qkv for p in processors)
        held: list[str] = []
        model.register_forward_hook(functools.partial(_gathered_into, held))
        out, saved, grads = step(model, inputs(rank, batch=1))
        full = {n: g.full_tensor() for n, g in grads.items()}
        report[name] = ((mlps, attentions), out, saved, full, sorted({n.split(".")[0] for n in held}))
    return report


@pytest.mark.timeout(180)
def test_under_fsdp2_split_blocks_on_two_ranks_the_gradients_are_equal(tmp_path):
    for report in run_ranks(lora_step_on_ranks, 2, str(tmp_path), timeout=150):
        blocks, plain, lean = report["blocks"], report["split"], report["lean"]
        assert (blocks[0], plain[0], lean[0]) == ((0, 0), (0, 0), (3, 2))
        assert torch.equal(plain[1], blocks[1]) and torch.equal(lean[1], plain[1]) and lean[2] < plain[2]
        assert plain[3].keys() == lean[3].keys() == blocks[3].keys() and plain[3]
        for name, grad in plain[3].items():
            assert torch.equal(plain[3][name], blocks[3][name]), name
            assert torch.equal(lean[3][name], grad), name
        # FSDP2 keeps the root group gathered from its forward to the end of backward: whole blocks leave the root's
        # children (SD3's embedders and output head) in it; split, they are groups of their own, freed after forward
        root_children = ["context_embedder", "norm_out", "pos_embed", "proj_out", "time_text_embed"]
        assert (blocks[4], plain[4], lean[4]) == (root_children, [], [])
