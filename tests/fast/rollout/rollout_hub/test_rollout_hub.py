"""The rollout hub's registry: one entry per declared algorithm, its kind agreeing with the declaration, the run's
entry under --train-only, and a plugin's entry registered beside the built-ins."""

from types import SimpleNamespace

import pytest

from miles.algorithms import ALGORITHMS, BUILTIN_ALGORITHMS, Algorithm
from miles.rollout.rollout_hub import (
    ROLLOUT_SPECS,
    DatasetSpec,
    RolloutSpec,
    get_rollout_spec,
    nft_pairs,
    nft_pairs_count,
    ode_request,
    rollout_spec_of,
)
from miles.rollout.rollout_hub import sft as sft_side


def run(loss_type, train_only=False):
    return SimpleNamespace(loss_type=loss_type, train_only=train_only)


@pytest.fixture
def plugin(monkeypatch):
    """Register a plugin's declaration and entry for one test, as an --algorithm-path module would."""

    def register(name, spec, **declaration):
        monkeypatch.setitem(ALGORITHMS, name, Algorithm(name=name, **declaration))
        monkeypatch.setitem(ROLLOUT_SPECS, name, spec)

    return register


def test_every_built_in_algorithm_has_an_entry_of_the_kind_its_declaration_says():
    for algorithm in BUILTIN_ALGORITHMS:  # not ALGORITHMS: plugins other tests registered may lack a rollout side
        spec = get_rollout_spec(algorithm.name)
        assert isinstance(spec, RolloutSpec if algorithm.uses_engines else DatasetSpec), algorithm.name


def test_train_only_runs_the_dataset_entry_of_the_loss_type():
    assert rollout_spec_of(run("sft_loss", train_only=True)) is sft_side.SPEC
    assert rollout_spec_of(run("custom_loss", train_only=True)) is sft_side.SPEC  # a custom loss on SFT's pairs
    assert rollout_spec_of(run("custom_loss")) is get_rollout_spec("custom_loss")
    with pytest.raises(ValueError, match="--train-only trains on dataset pairs, and --loss-type nft names none"):
        rollout_spec_of(run("nft", train_only=True))


def test_an_unregistered_loss_type_names_the_plugin_registry():
    with pytest.raises(ValueError, match=r"no rollout entry for --loss-type nope .*ROLLOUT_SPECS\['nope'\]"):
        get_rollout_spec("nope")


def test_a_plugin_entry_joins_the_registry(plugin):
    spec = RolloutSpec(build_request=ode_request, convert=nft_pairs, pairs_per_sample=nft_pairs_count)
    plugin("plugged", spec, samples_sde=False)
    assert rollout_spec_of(run("plugged")) is spec


def test_an_entry_of_the_wrong_kind_for_its_declaration_is_an_error(plugin):
    plugin("engine_less", RolloutSpec(ode_request, nft_pairs, nft_pairs_count), uses_engines=False)
    with pytest.raises(ValueError, match="uses_engines=False, so its ROLLOUT_SPECS entry must be a DatasetSpec"):
        get_rollout_spec("engine_less")
    plugin("from_data", sft_side.SPEC)
    with pytest.raises(ValueError, match="uses_engines=True, so its ROLLOUT_SPECS entry must be a RolloutSpec"):
        get_rollout_spec("from_data")


def test_an_entry_without_a_declaration_is_refused(monkeypatch):
    monkeypatch.setitem(ROLLOUT_SPECS, "undeclared", sft_side.SPEC)
    with pytest.raises(ValueError, match="--loss-type 'undeclared' is unknown.*--algorithm-path"):
        get_rollout_spec("undeclared")
