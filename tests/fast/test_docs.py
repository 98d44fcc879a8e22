"""Docs that must match the code."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_cli_reference_is_generated_from_the_parser(load_script):
    module = load_script("scripts/gen_cli_reference.py")
    with open(os.path.join(ROOT, "docs", "user-guide", "cli-reference.md")) as f:
        assert f.read() == module.render(), "run: python scripts/gen_cli_reference.py"


def test_train_diffusion_help_parses():
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "train_diffusion.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "--loss-type" in out.stdout
