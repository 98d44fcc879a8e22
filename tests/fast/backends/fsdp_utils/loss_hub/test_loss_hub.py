"""The loss hub: the hooks a --loss-type runs (built-in entries and custom_loss's from files), checked at start-up
against the hook contract (prepare's microbatch_id / optim_step_idx / pad_to_len, the formula's keywords, the
recompute keywords with a log-prob ratio, the train output's), failing with the file, the hook and what to change."""

import argparse

import pytest

from miles.backends.fsdp_utils.loss_hub import (
    LOSS_HOOKS,
    HookSignatureError,
    LossHooks,
    check_hook_signature,
    check_loss_hooks,
    get_loss_hooks,
)


def make_args(**overrides):
    base = dict(
        loss_type="custom_loss",
        custom_prepare_train_batch_path=None,
        custom_loss_function_path=None,
        custom_train_input_postprocess_path=None,
        custom_train_output_path=None,
    )
    base.update(overrides)
    return argparse.Namespace(**base)


GOOD = """
def prepare(ctx, batch, *, microbatch_id, optim_step_idx, pad_to_len=None):
    return None

def formula(ctx, batch, prepared, **kwargs):
    return None

def output(ctx, train_pairs, train_output_inputs):
    return None
"""
OLD = """
def prepare(ctx, batch, *, pad_to_len=None):
    return None

def output(ctx, train_pairs):
    return None

def formula(ctx, batch, prepared, *, new_pred, metrics):
    return None
"""


@pytest.fixture
def hook_file(tmp_path):
    (tmp_path / "good.py").write_text(GOOD)
    (tmp_path / "old.py").write_text(OLD)
    return tmp_path


def test_custom_loss_hooks_load_from_files(hook_file):
    good = hook_file / "good.py"
    hooks = get_loss_hooks(
        make_args(
            custom_prepare_train_batch_path=f"{good}:prepare",
            custom_loss_function_path=f"{good}:formula",
            custom_train_output_path=f"{good}:output",
        ),
        "actor",
    )
    assert hooks.prepare.__name__ == "prepare" and hooks.train_output.__name__ == "output"


def test_old_prepare_signature_rejected_naming_file_hook_and_params(hook_file):
    old, good = hook_file / "old.py", hook_file / "good.py"
    args = make_args(custom_prepare_train_batch_path=f"{old}:prepare", custom_loss_function_path=f"{good}:formula")
    with pytest.raises(HookSignatureError) as exc:
        get_loss_hooks(args, "actor")
    message = str(exc.value)
    assert "prepare" in message and str(old) in message
    assert "microbatch_id" in message and "optim_step_idx" in message


def test_two_parameter_train_output_rejected(hook_file):
    old, good = hook_file / "old.py", hook_file / "good.py"
    args = make_args(
        custom_prepare_train_batch_path=f"{good}:prepare",
        custom_loss_function_path=f"{good}:formula",
        custom_train_output_path=f"{old}:output",
    )
    with pytest.raises(HookSignatureError, match=r"train_output hook .*old\.py.*train_output_inputs"):
        get_loss_hooks(args, "actor")


def test_formula_without_kwargs_must_name_every_keyword(hook_file):
    old, good = hook_file / "old.py", hook_file / "good.py"
    args = make_args(custom_prepare_train_batch_path=f"{good}:prepare", custom_loss_function_path=f"{old}:formula")
    with pytest.raises(HookSignatureError, match="optim_step_idx.*train_output_inputs"):
        get_loss_hooks(args, "actor")


RETIRED = """
def prepare(ctx, batch, *, microbatch_id, optim_step_idx, pad_to_len=None):
    return None

def formula(ctx, batch, prepared, *, new_pred, ref_pred, metrics, optim_step_idx, train_output_inputs):
    return None

def formula_kwargs(ctx, batch, prepared, *, new_pred, ref_pred=None, **kwargs):
    return None
"""


@pytest.mark.parametrize("name", ["formula", "formula_kwargs"])
def test_a_formula_still_taking_ref_pred_fails_at_start_up_saying_what_replaced_it(tmp_path, name):
    (tmp_path / "retired.py").write_text(RETIRED)
    hooks = tmp_path / "retired.py"
    args = make_args(custom_prepare_train_batch_path=f"{hooks}:prepare", custom_loss_function_path=f"{hooks}:{name}")
    with pytest.raises(HookSignatureError) as exc:
        get_loss_hooks(args, "actor")
    message = str(exc.value)
    assert str(hooks) in message and 'ref_pred became frozen_preds["ref"]' in message


def test_a_prepare_must_take_pad_to_len_which_the_trunk_passes_explicitly():
    def without(ctx, batch, *, microbatch_id, optim_step_idx):
        return None

    def with_kwargs(ctx, batch, *, microbatch_id, **kwargs):
        return None

    with pytest.raises(HookSignatureError, match=r"prepare hook mine\.py:without: missing .*pad_to_len"):
        check_hook_signature("prepare", without, "mine.py:without")
    check_hook_signature("prepare", with_kwargs, "mine.py:with_kwargs")  # **kwargs takes whatever the trunk adds


def test_the_recompute_keywords_are_required_only_with_a_log_prob_ratio():
    def formula(ctx, batch, prepared, *, new_pred, frozen_preds, metrics, optim_step_idx, train_output_inputs):
        return None

    hooks = LossHooks(prepare=LOSS_HOOKS[("sft_loss", "actor")].prepare, formula=formula)
    check_loss_hooks(hooks)
    with pytest.raises(HookSignatureError, match="write_old_log_prob, old_log_prob_from_new"):
        check_loss_hooks(hooks, log_prob_ratio=True)
    check_hook_signature("formula", LOSS_HOOKS[("policy_loss", "actor")].formula, "policy", ("write_old_log_prob",))


def test_builtin_hooks_pass_the_check_their_declaration_asks():
    for loss_type, role in LOSS_HOOKS:
        if loss_type in ("sft_loss", "policy_loss", "nft", "dmd2"):
            get_loss_hooks(make_args(loss_type=loss_type), role)


def test_an_entry_whose_engine_weights_the_declaration_lacks_fails_at_get_loss_hooks(monkeypatch):
    entry = LOSS_HOOKS[("policy_loss", "actor")]
    monkeypatch.setitem(
        LOSS_HOOKS, ("policy_loss", "actor"), LossHooks(entry.prepare, entry.formula, engine_weights="old")
    )
    with pytest.raises(ValueError, match="--loss-type policy_loss role 'actor': engine_weights 'old'"):
        get_loss_hooks(make_args(loss_type="policy_loss"), "actor")
