"""A rollout engine's end of the weight sync (`DiffusionEngine.open_weight_sync` / `receive_weights`), with the
trainer's rank 0 on this thread: a bf16 LoRA engine takes the fp32 adapter only, into its parameters in place, also
after a sleep that dropped them; a plan that leaves a full engine's tensor out is refused before the group forms."""

from __future__ import annotations

import pytest
import torch

from miles.rollout.engine import DiffusionEngine
from miles.utils.weight_checksum import WeightSyncError
from miles.weight_sync.transports import TransportSpec
from tests.fast.weight_sync.sync_helpers import plan_of, run_sync

LORA = dict(r=4, lora_alpha=8, target_modules=["to_q", "to_v"], init_lora_weights=True)


def test_a_bf16_lora_engine_takes_the_fp32_adapter_in_place_and_again_after_a_dropping_sleep(tiny_pipeline_dir):
    engine = DiffusionEngine(tiny_pipeline_dir, forward_dtype=torch.bfloat16, lora_config=LORA)
    params = dict(engine.transformer.named_parameters())
    base = {n: p.detach().clone() for n, p in params.items() if "lora_" not in n}
    generator = torch.Generator().manual_seed(0)
    # the trainer's names (the model's, with the adapter name) and dtype (fp32, as trained)
    sent = [{n: torch.randn(p.shape, generator=generator) for n, p in params.items() if "lora_" in n} for _ in range(2)]
    pointers = {n: params[n].data_ptr() for n in sent[0]}
    plan = plan_of(sent[0], bucket_bytes=4096)

    seen = []

    def take(spec: TransportSpec, rank: int) -> None:
        engine.open_weight_sync(spec, plan, rank)
        engine.receive_weights(1)
        same = all(torch.equal(params[n], t.bfloat16()) for n, t in sent[0].items())
        seen.append((engine.get_version(), same, {n: params[n].data_ptr() for n in sent[0]} == pointers))
        engine.sleep(discard_weights=True)  # --colocate-sleep: the adapter is freed, the next sync refills it
        seen.append(engine.weights_pending)
        engine.receive_weights(2)

    run_sync("shm", sent, [take], plan=plan)
    assert seen == [(1, True, True), True]  # copied in place: the same storage
    assert engine.get_version() == 2 and not engine.weights_pending
    for name, tensor in sent[1].items():
        assert torch.equal(params[name], tensor.to(torch.bfloat16)), name
    after = dict(engine.transformer.named_parameters())
    assert all(after[n] is params[n] for n in sent[0])  # after the wake (storage reallocated): the same parameters
    assert all(torch.equal(params[n], t) for n, t in base.items())  # the base weights are neither sent nor touched


def test_a_plan_that_leaves_a_full_engines_tensor_out_fails_before_the_group_forms(tiny_pipeline_dir):
    engine = DiffusionEngine(tiny_pipeline_dir)
    state = engine.transformer.state_dict()
    plan = plan_of({n: t for n, t in state.items() if n != "proj_out.bias"})
    spec = TransportSpec("shm", "127.0.0.1", 1, 2, plan.buffer_bytes, 1.0, "/nonexistent")
    with pytest.raises(WeightSyncError, match=r"leaves 1 engine tensors unchanged, e.g. \['proj_out.bias'\]"):
        engine.open_weight_sync(spec, plan, 1)
    assert engine.sync is None
