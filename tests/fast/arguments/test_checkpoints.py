"""The checkpoint and restart flags' rules (miles/arguments/checkpoints.py): --max-restarts needs a save folder,
--restart-min-dp-size only shrinks and not a colocated run."""

from __future__ import annotations

import pytest

from miles.arguments.parser import parse_args
from tests.fast.arguments.test_parser import parse_error


def args_for(*flags: str):
    return parse_args(["--hf-checkpoint", "builtin:tiny-shapes", "--loss-type", "nft", *flags])


def test_max_restarts_needs_a_save_folder(capsys):
    for flags, error in [
        (("--max-restarts", "2"), "--max-restarts 2 resumes from the latest checkpoint in --save: pass --save DIR"),
        (("--max-restarts", "-1", "--save", "x"), "--max-restarts must be ≥ 0, got -1"),
        (("--restart-timeout", "0", "--save", "x"), "--restart-timeout must be > 0, got 0.0"),
    ]:
        with pytest.raises(SystemExit):
            args_for(*flags)
        assert error in capsys.readouterr().err
    assert args_for("--save", "x").max_restarts == 0


def test_restart_min_dp_size_is_refused_where_a_run_cannot_shrink(capsys):
    base = ["--hf-checkpoint", "/tmp/x", "--prompt-data", "builtin:shapes", "--save", "/tmp/s", "--max-restarts", "1"]
    err = parse_error([*base, "--restart-min-dp-size", "4"], capsys)
    assert "--restart-min-dp-size 4 is above --dp-size 2: a restart only shrinks the run" in err
    err = parse_error([*base, "--restart-min-dp-size", "1", "--colocate"], capsys)
    assert "--restart-min-dp-size with --colocate" in err
    err = parse_error(base[:6] + ["--restart-min-dp-size", "1"], capsys)  # without --max-restarts: read by nothing
    assert "--restart-min-dp-size" in err and "--max-restarts" in err
