"""Joint attention concatenating its tokens in the projections' layout (`joint_attention.py`): the attention's output
kept once for backward instead of twice, and with `recompute_qkv` q, k, v not kept (projected again in backward), the
same outputs and gradients (`torch.equal`), also with SD3.5's q / k norms and its second (image-only) attention."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.attention_processor import JointAttnProcessor2_0

from miles.backends.fsdp_utils.frozen_mlp import lean_frozen_mlps
from miles.backends.fsdp_utils.joint_attention import LeanJointAttnProcessor, lean_joint_attention
from tests.fast.backends.fsdp_utils.test_frozen_mlp import BATCH, IMAGE_TOKENS, TEXT_TOKENS, WIDTH, inputs, sd3, step

SD35 = {"qk_norm": "rms_norm", "dual_attention_layers": (0,)}


@pytest.mark.parametrize(
    ("layout", "batch", "recompute_qkv"),
    [({}, 1, False), ({}, 1, True), (SD35, 1, True), ({}, BATCH, True), ({"lora": False}, BATCH, True)],
    ids=["sd3-keep-qkv", "sd3", "sd3.5", "batch2", "trained"],
)
def test_the_attention_output_is_saved_once_with_equal_outputs_and_gradients(layout, batch, recompute_qkv):
    plain, lean = sd3(**layout), sd3(**layout)
    joint = [m for m in lean.modules() if type(getattr(m, "processor", None)) is JointAttnProcessor2_0]
    assert lean_joint_attention(lean, recompute_qkv) == len(joint) == 2 + len(layout.get("dual_attention_layers", ()))
    assert lean_joint_attention(lean) == 0 and all(type(m.processor) is LeanJointAttnProcessor for m in joint)
    out, saved, grads = step(plain, inputs(batch=batch))
    lean_out, lean_saved, lean_grads = step(lean, inputs(batch=batch))
    assert torch.equal(lean_out, out)
    assert grads.keys() == lean_grads.keys() and len(grads) >= 30
    for name, grad in grads.items():
        assert torch.equal(lean_grads[name], grad), name
    # a batch of one: one (image + text tokens, width) fp32 copy less per joint attention (the output projections'
    # adapters keep views of the attention's output). Larger batches: the same bytes (the image and text rows of a
    # batch are not contiguous, so `F.linear` copies each part and the adapters keep those copies either way).
    # SD3.5's image-only second attention had no copy (its heads are views of the projections).
    copy = 2 * (IMAGE_TOKENS + TEXT_TOKENS) * WIDTH * 4 if batch == 1 else 0
    if not recompute_qkv:
        assert saved - lean_saved == copy
    elif not layout:  # and q, k, v (width each) and the adapters' rank-4 hidden rows of the six projections
        assert saved - lean_saved == copy + 2 * 3 * batch * (IMAGE_TOKENS + TEXT_TOKENS) * (WIDTH + 4) * 4
    elif "lora" in layout:  # fully trained: the projections' weights get their gradients through the recompute
        assert lean_saved < saved
    else:  # SD3.5 also the q / k norms' inputs
        assert saved - lean_saved > copy + 2 * 3 * batch * (IMAGE_TOKENS + TEXT_TOKENS) * (WIDTH + 4) * 4


def test_without_grad_and_with_inputs_it_does_not_handle_it_computes_what_diffusers_does():
    plain, lean = sd3(lora=False), sd3(lora=False)
    lean_joint_attention(lean)
    with torch.no_grad():
        assert torch.equal(lean(**inputs(), return_dict=False)[0], plain(**inputs(), return_dict=False)[0])
    attn = lean.transformer_blocks[0].attn
    image, text = torch.randn(BATCH, IMAGE_TOKENS, WIDTH), torch.randn(BATCH, TEXT_TOKENS, WIDTH)
    mask = torch.ones(BATCH, IMAGE_TOKENS + TEXT_TOKENS, dtype=torch.bool)  # handed to diffusers' processor
    lean_result = attn.processor(attn, image, text, mask)
    plain_result = JointAttnProcessor2_0()(attn, image, text, mask)
    assert all(torch.equal(a, b) for a, b in zip(lean_result, plain_result))


def test_with_lean_mlps_the_joint_block_hands_the_attention_its_unnormalised_stream():
    """Both installed (as `apply_fsdp2` does): `norm1` hands the attention the stream and its modulation, and the
    attention keeps the stream (which the norm kept anyway) instead of the modulated stream as well."""
    plain, lean = sd3(), sd3()
    lean_joint_attention(lean)
    lean_frozen_mlps(lean)
    out, saved, grads = step(plain, inputs(batch=1))
    lean_out, lean_saved, lean_grads = step(lean, inputs(batch=1))
    assert torch.equal(lean_out, out) and grads.keys() == lean_grads.keys()
    for name, grad in grads.items():
        assert torch.equal(lean_grads[name], grad), name
    tokens = IMAGE_TOKENS + TEXT_TOKENS
    mlps = (2 * IMAGE_TOKENS + TEXT_TOKENS) * (4 * WIDTH + 2) * 4 + 3 * WIDTH * 4  # test_frozen_mlp's count
    copy_and_qkv = 2 * tokens * WIDTH * 4 + 2 * 3 * tokens * (WIDTH + 4) * 4  # the test above's
    # the modulated image stream, the norm's mean and rstd, `1 + scale`: in block 1 (block 0's input needs no
    # gradient: its norm kept nothing, its adapters the modulated stream, now the stream instead)
    norm1 = (IMAGE_TOKENS * WIDTH + 2 * IMAGE_TOKENS + WIDTH) * 4
    assert saved - lean_saved == mlps + copy_and_qkv + norm1
