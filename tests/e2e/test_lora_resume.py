"""A LoRA run's checkpoint holds the adapter and what trains with it, not the frozen base (rebuilt from
--hf-checkpoint on resume): the resumed run continues the uninterrupted one's series bit for bit."""

from __future__ import annotations

import os

import pytest

from miles.backends.fsdp_utils.checkpoint import checkpoint_dir, read_dcp_metadata
from miles.ray.checkpoint_folders import ResumeSettingsError
from tests.e2e.test_golden import COMMON, RUNS, run_series

pytestmark = pytest.mark.e2e
FLAGS = [*RUNS["nft"], "--use-lora", "--lora-rank", "4"]


def test_a_lora_run_resumes_from_its_adapter_only_checkpoint_bit_for_bit(ray_cluster, tmp_path):
    whole = run_series("nft", str(tmp_path / "whole"), *FLAGS)
    save = str(tmp_path / "ckpt")
    run_series("nft", str(tmp_path / "first"), *FLAGS, "--num-rollout", "1", "--save", save, "--save-interval", "1")
    stored = read_dcp_metadata(os.path.join(checkpoint_dir(save, 0, "actor"), "dcp", ".metadata"))
    weights = [k for k in stored.state_dict_metadata if k.startswith("model.") and k.endswith((".weight", ".bias"))]
    base = [k for k in weights if "lora_" not in k]
    assert weights and not base, base  # the adapter's weights only (buffers such as SD3's pos_embed stay)
    with pytest.raises(
        ResumeSettingsError, match=r"rank-4 LoRA adapter, not full weights: .* --use-lora --lora-rank 4"
    ):
        run_series("nft", str(tmp_path / "full"), "--load", save)  # refused at start-up, naming the flag
    resumed = run_series("nft", str(tmp_path / "resumed"), *FLAGS, "--load", save)
    assert resumed and resumed == whole[-len(resumed) :]
    assert COMMON[COMMON.index("--num-rollout") + 1] == "2"  # the resumed run is the whole run's second rollout
