"""benchmarks/bench_real_size.py's set-up at a tiny size (its runs take minutes): the options, the pipeline folder it
builds, the flags it gives miles and the weight sync's size."""

import pytest
import torch
from diffusers import WanTransformer3DModel

from miles.arguments.parser import parse_args
from miles.models.wan.wan import WanPipelineConfig


@pytest.fixture(scope="module")
def bench(load_script):
    return load_script("benchmarks/bench_real_size.py")


@pytest.fixture(scope="module")
def folder(bench, tmp_path_factory):
    config = {**bench.wan_1_3b_config(1), "num_attention_heads": 2, "attention_head_dim": 16, "ffn_dim": 64}
    config["text_dim"] = 32
    return bench.save_real_size_wan_pipeline(str(tmp_path_factory.mktemp("wan") / "pipeline"), config)


def test_defaults_are_wan_1_3b_with_lora_and_bad_sizes_are_refused(bench):
    opts = bench.parse_options([])
    assert (opts.layers, opts.weights, opts.num_frames, opts.resolution) == (30, "lora", 5, 64)
    config = bench.wan_1_3b_config()
    assert config["num_attention_heads"] * config["attention_head_dim"] == 1536 and config["num_layers"] == 30
    for bad in (["--resolution", "40"], ["--num-frames", "4"], ["--layers", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_options(bad)


def test_folder_is_a_wan_pipeline_with_real_length_text_and_16_latent_channels(folder):
    family = WanPipelineConfig(folder, num_frames=5)
    assert family.max_sequence_length == 512  # Wan's padding, not the tiny tokenizer's 32
    assert family.latent_shape(64) == (16, 2, 8, 8)
    embeds = family.encode_prompts(["a red circle"])["prompt_embeds"]
    assert embeds.shape == (1, 512, 32)  # the text encoder is as wide as the transformer's text_dim


def test_run_flags_parse_and_the_synced_bytes_are_the_transformers_state_dict(bench, folder):
    full = parse_args([*bench.run_flags(bench.parse_options(["--weights", "full"]), folder), "--num-rollout", "1"])
    assert not full.use_lora and full.fsdp_master_dtype == "bf16" and full.loss_type == "policy_loss"
    tensors, _, nbytes = bench.synced_state(folder, full)
    loaded = WanTransformer3DModel.from_pretrained(folder, subfolder="transformer", torch_dtype=torch.bfloat16)
    state = loaded.state_dict()  # diffusers' own load: bf16, its _keep_in_fp32_modules in fp32
    assert (tensors, nbytes) == (len(state), sum(t.numel() * t.element_size() for t in state.values()))

    lora = parse_args([*bench.run_flags(bench.parse_options([]), folder), "--num-rollout", "1"])
    _, values, _ = bench.synced_state(folder, lora)
    suffixes = (".to_q", ".to_k", ".to_v", ".to_out.0")  # the wan family's LoRA targets: both attentions of a block
    targets = [m for name, m in loaded.named_modules() if name.endswith(suffixes)]
    assert len(targets) == 8 and all(isinstance(m, torch.nn.Linear) for m in targets)
    assert values == sum(lora.lora_rank * (m.in_features + m.out_features) for m in targets)  # A: r x in, B: out x r
