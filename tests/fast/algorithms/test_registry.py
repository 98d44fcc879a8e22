"""The algorithm registry: a plugin's declaration joins the built-ins under a free name only, and an unknown
--loss-type is named with the choices and where to declare one."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from miles.algorithms.registry import ALGORITHMS, algorithm_of, get_algorithm, register_algorithm


@pytest.fixture
def registry():
    saved = dict(ALGORITHMS)
    yield ALGORITHMS
    ALGORITHMS.clear()
    ALGORITHMS.update(saved)


def test_a_declaration_registers_under_a_free_name_only(registry):
    nft = registry["nft"]
    assert register_algorithm(nft) is nft  # the same record again: nothing changes
    plugin = dataclasses.replace(nft, name="my_nft")
    assert register_algorithm(plugin) is plugin and algorithm_of(SimpleNamespace(loss_type="my_nft")) is plugin
    with pytest.raises(ValueError, match="algorithm 'nft' is registered already"):
        register_algorithm(dataclasses.replace(nft, name="nft"))


def test_an_unknown_loss_type_names_the_choices_and_the_plugin_flag():
    with pytest.raises(ValueError, match=r"--loss-type 'nfx' is unknown: choose one of .*\bnft\b.*--algorithm-path"):
        get_algorithm("nfx")
