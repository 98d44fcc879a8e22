"""LoRA targets a network lacks, by peft's matching rule (exact or `.name` suffix; a string is a full regex), and
the error that names them and whose network it is."""

from __future__ import annotations

import pytest
from torch import nn

from miles.models.lora_targets import check_lora_targets, missing_lora_targets


def network() -> nn.Module:
    block = nn.Module()
    block.to_q, block.to_out = nn.Linear(2, 2), nn.ModuleList([nn.Linear(2, 2)])
    root = nn.Module()
    root.blocks = nn.ModuleList([block])
    return root


def test_listed_names_match_whole_names_or_dotted_suffixes():
    assert missing_lora_targets(network(), ["to_q", "to_out.0", "blocks.0.to_q"]) == []
    assert missing_lora_targets(network(), ["to_q", "q", "to_k", "out.0"]) == ["q", "to_k", "out.0"]


def test_a_string_is_a_regular_expression_over_the_whole_name():
    assert missing_lora_targets(network(), r"blocks\.\d+\.to_q") == []
    assert missing_lora_targets(network(), "to_q") == ["to_q"]  # not a suffix match


def test_the_error_names_the_missing_targets_and_the_network():
    check_lora_targets(network(), ["to_q"], "the trainer's transformer")
    with pytest.raises(
        ValueError, match=r"--lora-target-modules \['to_v'\] match no module of the engine's x \(Module\)"
    ):
        check_lora_targets(network(), ["to_q", "to_v"], "the engine's x")
