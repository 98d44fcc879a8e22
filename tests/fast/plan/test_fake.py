"""The planner's fake world (miles/plan/fake.py)."""

from __future__ import annotations

import torch


def test_per_tensor_equivalents_give_diffusers_tensors_and_are_restored():
    """The planner's loop-free HunyuanVideo 1.5 VAE attention mask equals diffusers' own (values, dtype, size)."""
    from diffusers.models.autoencoders.autoencoder_kl_hunyuanvideo15 import HunyuanVideo15AttnBlock

    from miles.plan.fake import per_tensor_equivalents

    own = HunyuanVideo15AttnBlock.prepare_causal_attention_mask
    cases = [(3, 4, None, torch.float32), (5, 7, 2, torch.float32), (2, 3, None, torch.bfloat16)]
    expected = [own(n, hw, dtype, "cpu", batch_size=b) for n, hw, b, dtype in cases]
    with per_tensor_equivalents():
        assert HunyuanVideo15AttnBlock.prepare_causal_attention_mask is not own
        got = [HunyuanVideo15AttnBlock.prepare_causal_attention_mask(n, hw, d, "cpu", b) for n, hw, b, d in cases]
    assert HunyuanVideo15AttnBlock.prepare_causal_attention_mask is own
    for a, b in zip(expected, got):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_a_cuda_plan_takes_the_trainers_cuda_choices_on_the_fake_cpu_device():
    """FSDP2's gathers keep their defaults and SD3's joint attention keeps q, k, v in a CUDA plan; a CPU plan (or a
    real run) keeps the CPU choices, and leaving restores them."""
    from miles.backends.fsdp_utils import fsdp, joint_attention
    from miles.plan.fake import device_paths

    states, cpu_gathers = torch.empty(1, 4, 8), fsdp.gather_one_group_at_a_time
    with device_paths("cuda"):
        assert not joint_attention._cpu_flash(states) and fsdp.gather_one_group_at_a_time is not cpu_gathers
    for planned, fake in (("cpu", True), ("cuda", False)):
        with device_paths(planned, fake):
            assert joint_attention._cpu_flash(states) and fsdp.gather_one_group_at_a_time is cpu_gathers
    assert joint_attention._cpu_flash(states) and fsdp.gather_one_group_at_a_time is cpu_gathers


def test_value_only_inplace_ops_skip_the_fake_dispatch_and_keep_its_errors():
    """An in-place op that writes values only returns its fake tensor untouched (same object, version bumped,
    autograd intact) without the fake dispatch; a broadcast the real op refuses, an int written from a float, or a
    constant-holding tensor still goes through it (its errors, its constant)."""
    from unittest import mock

    from torch._subclasses.fake_tensor import FakeTensorMode

    from miles.plan.fake import PlanTensorMode

    with PlanTensorMode():
        a, row, longer = torch.empty(4, 3), torch.empty(3), torch.empty(5)
        ints, x = torch.zeros(4, 3, dtype=torch.long), torch.empty(3, requires_grad=True)
        own, dispatched = FakeTensorMode.dispatch, []

        def recorded(mode, func, *rest):
            dispatched.append(func)
            return own(mode, func, *rest)

        with mock.patch.object(FakeTensorMode, "dispatch", recorded):
            version = a._version
            assert a.add_(row) is a and a.lerp_(a, 0.5) is a and a.addcmul_(a, a, value=2.0) is a
            assert ints.copy_(a) is ints and a.zero_() is a and a._version == version + 4
        assert not [func for func in dispatched if func is not torch.ops.prim.device.default], dispatched
        for refused in (lambda: a.add_(longer), lambda: ints.add_(1.5), lambda: row.add_(a)):
            try:
                refused()
            except RuntimeError:
                continue
            raise AssertionError("the fake dispatch's error was skipped")
        constant = torch.tensor(3.0)
        constant.add_(1.0)
        assert constant.item() == 4.0
        y = x * 2
        y.mul_(3)
        y.sum().backward()
        assert x.grad is not None and x.grad.shape == (3,)


def test_swap_bits_is_skipped_on_fake_tensors_only_and_restored():
    """`value_only_ops_skipped`: the shadow swap does nothing on fake tensors (but still refuses a dtype or shape
    mismatch), swaps real ones bit for bit, and leaving restores the library's function."""
    from miles.backends.fsdp_utils import ema
    from miles.plan.fake import PlanTensorMode, value_only_ops_skipped

    own = ema.swap_bits_
    a, b = torch.tensor([1.0, -0.0]), torch.tensor([float("nan"), 2.0])
    with value_only_ops_skipped():
        assert ema.swap_bits_ is not own
        ema.swap_bits_(a, b)
        assert a[1] == 2.0 and torch.isnan(a[0]) and b[0] == 1.0
        with PlanTensorMode():
            x, y = torch.empty(3), torch.empty(3)
            ema.swap_bits_(x, y)
            try:
                ema.swap_bits_(x, torch.empty(3, dtype=torch.float64))
            except ValueError:
                pass
            else:
                raise AssertionError("a dtype mismatch was not refused")
    assert ema.swap_bits_ is own


def test_fsdp2_chunks_made_as_read_are_torch_chunks():
    """`value_only_ops_skipped` makes FSDP2's chunks of a fake parameter as they are read: each is the view
    `torch.chunk` makes (empty ones past the end, as `_chunk_with_empty` pads), on real tensors the original."""
    from torch.distributed.fsdp._fully_shard import _fsdp_common, _fsdp_param

    from miles.plan.fake import PlanTensorMode, value_only_ops_skipped

    with PlanTensorMode(), value_only_ops_skipped():
        for shape, count, dim in [((10, 3), 8, 0), ((7,), 8, 0), ((64, 5), 8, 0), ((4, 9), 2, 1), ((3,), 1, 0)]:
            tensor = torch.empty(shape)
            made, expected = (
                _fsdp_param._chunk_with_empty(tensor, count, dim),
                _fsdp_common._chunk_with_empty(tensor, count, dim),
            )
            assert len(made) == len(expected) == count
            for i in [*range(count), -1]:
                a, b = made[i], expected[i]
                assert (a.shape, a.stride(), a.storage_offset()) == (b.shape, b.stride(), b.storage_offset())
                assert a.untyped_storage().nbytes() == b.untyped_storage().nbytes()
        assert isinstance(_fsdp_param._chunk_with_empty(torch.empty(4), 2, 0), list) is False
    assert isinstance(_fsdp_param._chunk_with_empty(torch.zeros(4), 2, 0), list)


def test_pin_memory_is_a_fake_copy():
    """`pin_memory` (FSDP2's host shards under --fsdp-cpu-offload) has no fake kernel: the planner's mode answers
    with a copy of the same shape and dtype in a storage of its own, as the page-locked copy is."""
    from miles.plan.fake import PlanTensorMode

    with PlanTensorMode():
        host = torch.empty(3, 5, dtype=torch.bfloat16)
        pinned = host.pin_memory()
        assert pinned.shape == host.shape and pinned.dtype == host.dtype
        assert pinned.untyped_storage() is not host.untyped_storage()
