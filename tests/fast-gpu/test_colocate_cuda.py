"""--colocate-sleep on CUDA: a sleep gives the device memory back (the caching allocator's blocks included) and a
wake brings the same bits back; an engine and a trainer rank sharing one GPU take turns (a whole run, auto mode)."""

import json

import pytest
import torch

from miles.utils.offload import HostSwap, host_offsets

pytestmark = pytest.mark.gpu
MIB = 1 << 20


def test_host_swap_frees_the_device_memory_into_one_pinned_host_buffer_and_restores_the_bits():
    device = torch.device("cuda", torch.cuda.current_device())
    big = torch.randn(64 * MIB // 4, device=device)
    view = big[:1024]
    expected = big.cpu()
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved(device)
    swap = HostSwap(device)
    report = swap.sleep([big, view])
    assert report.copied_bytes == 64 * MIB and report.storages == 1
    assert swap.host.is_pinned()  # one pinned buffer for every storage
    assert before - torch.cuda.memory_reserved(device) >= 64 * MIB  # empty_cache returned the block
    swap.wake()
    assert torch.equal(big.cpu(), expected) and torch.equal(view.cpu(), expected[:1024])


def test_sleeping_1_1_gib_pins_exactly_those_bytes_outside_the_caching_host_allocator_and_frees_a_replaced_buffer():
    device = torch.device("cuda", torch.cuda.current_device())
    sizes = [2**30 // 40 * 4 + 4000 * k for k in range(11)]  # 1.1 GiB in all (not a power of two), odd sizes
    tensors = [torch.full((n // 4,), float(k), device=device) for k, n in enumerate(sizes)]
    torch.cuda.synchronize()
    cached_before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    swap = HostSwap(device)
    swap.sleep(tensors[:5])  # a first, smaller sleep (as before the optimizer state exists)
    first = swap.host.data_ptr()
    swap.wake()
    report = swap.sleep(tensors)
    exact = host_offsets(sizes)[1]
    assert report.copied_bytes == sum(sizes) and swap.host.numel() == exact  # not rounded up to 2 GiB
    assert swap.host.is_pinned() and swap.host.data_ptr() != first  # the smaller buffer was replaced
    assert torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) == cached_before  # nothing cached
    swap.wake()
    assert all(torch.equal(t, torch.full_like(t, float(k))) for k, t in enumerate(tensors))
    swap.release()


def test_an_engine_on_cuda_sleeps_to_almost_nothing_and_samples_the_same_after_a_sync(tiny_pipeline_dir):
    from miles.rollout.engine import DiffusionEngine
    from miles.rollout.engine_api import GenerateRequest

    engine = DiffusionEngine(tiny_pipeline_dir, device="cuda")
    request = GenerateRequest(
        prompts=["a red circle on the left"] * 2,
        seeds=[1, 2],
        num_steps=4,
        guidance_scale=4.5,
        negative_prompt="",
        sde_type="sde",
        noise_level=0.7,
        trained_steps=[0, 1],
    )
    base = engine.generate(request)
    weights = {k: v.detach().cpu().clone() for k, v in engine.transformer.state_dict().items()}
    torch.cuda.synchronize()
    awake = torch.cuda.memory_allocated()
    report = engine.sleep(discard_weights=True)
    assert report["kept_bytes"] == 0 and report["discarded_bytes"] > 0
    assert torch.cuda.memory_allocated() < awake / 10
    engine.update_weights(weights, version=1)
    again = engine.generate(request)
    assert torch.equal(again.final_latents, base.final_latents) and torch.equal(again.log_probs, base.log_probs)


def test_one_gpu_shared_by_an_engine_and_a_rank_takes_turns_and_trains(ray_cluster, tiny_pipeline_dir, tmp_path):
    import train_diffusion
    from miles.arguments.parser import parse_args
    from miles.utils.tracking import read_metrics

    if ray_cluster.cluster_resources().get("GPU", 0) < 1:
        pytest.skip("the test's Ray cluster sees no GPU")
    args = parse_args(
        [
            "--hf-checkpoint",
            tiny_pipeline_dir,
            "--prompt-data",
            "builtin:shapes",
            "--loss-type",
            "nft",
            "--device",
            "cuda",
            "--dp-size",
            "1",
            "--gpus-per-rank",
            "0.5",
            "--rollout-gpus-per-engine",
            "0.5",
            "--num-rollout",
            "2",
            "--rollout-batch-size",
            "2",
            "--n-samples-per-prompt",
            "4",
            "--eval-interval",
            "0",
            "--image-grid-interval",
            "0",
            "--no-progress",
            "--output-dir",
            str(tmp_path),
        ]
    )
    train_diffusion.run(args)
    rollouts = [m for m in read_metrics(tmp_path / "metrics.jsonl") if "perf/generate_total_s" in m]
    assert len(rollouts) == 2 and all(m["perf/colocate_swap_s"] > 0 for m in rollouts)
    placement = json.loads((tmp_path / "placement.json").read_text())
    assert placement["engines"][0]["node_id"] == placement["actor"][0]["node_id"]
    assert placement["engines"][0]["gpus"] == placement["actor"][0]["gpus"]  # one GPU, which auto found shared
