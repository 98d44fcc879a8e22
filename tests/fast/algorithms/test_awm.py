"""The awm declaration's defaults: its KL weight follows the reference the run has, and what it chose is said."""

from __future__ import annotations

from miles.arguments.parser import parse_args
from tests.fast.arguments.test_parser import parse_error


def test_awm_without_a_reference_drops_the_kl_to_it_and_says_so():
    """The issue's case: `--loss-type awm` stopped on its own --awm-kl-beta 0.001 without --ref-mode."""
    args = parse_args(["--loss-type", "awm", "--num-rollout", "2"])
    assert args.awm_kl_beta == 0.0 and args.awm_ema_kl_beta == 1.0
    (note,) = args.default_notes
    assert note.startswith("--loss-type awm: no --ref-mode reference, so --awm-kl-beta is 0")
    assert "--use-lora --ref-mode lora_base" in note  # the authors' reference, named


def test_awm_with_a_reference_takes_the_authors_kl_weight():
    args = parse_args(["--loss-type", "awm", "--use-lora", "--ref-mode", "lora_base"])
    assert args.awm_kl_beta == 1e-3 and "the authors'" in args.default_notes[0]
    assert (
        parse_args(["--loss-type", "awm", "--awm-kl-beta", "0.01", "--use-ema", "--ref-mode", "ema"]).default_notes
        == ()
    )


def test_awm_given_a_kl_weight_without_a_reference_is_still_refused(capsys):
    err = parse_error(["--loss-type", "awm", "--awm-kl-beta", "0.001"], capsys)
    assert "--awm-kl-beta 0.001 needs the frozen reference v_ref: --ref-mode" in err
