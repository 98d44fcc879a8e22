"""Family options: declared once with their families, added to the parser once per flag, range-checked from the
declaration, passed to the families that declare them and refused by the others; all without importing a family."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from miles.arguments.parser import build_parser, parse_args
from miles.arguments.rules import flag_ranges
from miles.models import all_family_classes
from miles.models.options import FAMILY_OPTIONS, FamilyOption, add_family_arguments, family_options
from miles.utils.ranges import AT_LEAST_1, FLAG_RANGES

BASE = ["--hf-checkpoint", "/tmp/x", "--prompt-data", "builtin:shapes"]


def test_each_family_class_takes_the_options_declared_for_it():
    declared = {}
    for option in FAMILY_OPTIONS:
        declared.setdefault(option.family, set()).add(option.name)
    for name, cls in all_family_classes().items():
        assert {option.name for option in cls.options} == declared.get(name, set()), name
    wan = {"num_frames", "guidance_scale_2", "trained_experts"}
    z_image = {"cfg_normalization", "cfg_truncation"}
    assert declared == {
        "wan": wan,
        "wan-i2v": wan,
        "hunyuan-video15": {"num_frames", "vae_tiling"},
        "ltx2": {"num_frames", "vae_tiling"},
        "qwen-image": {"vae_tiling"},
        "qwen-image-edit": {"vae_tiling"},
        "qwen-image-edit-plus": {"vae_tiling"},
        "z-image": z_image,
    }


def test_a_flag_two_families_share_is_added_once_and_its_help_names_both():
    actions = [a for a in build_parser()._actions if "--num-frames" in a.option_strings]
    assert len(actions) == 1 and actions[0].type is int and actions[0].default is None
    assert "wan: default 81, 4k + 1" in actions[0].help and "ltx2: default 121, 8k + 1" in actions[0].help
    experts = next(a for a in build_parser()._actions if "--wan-trained-experts" in a.option_strings)
    assert (
        tuple(experts.choices) == ("both", "high-noise", "low-noise")
        and "wan: text-to-video; wan-i2v: image-to-video" in experts.help
    )


def test_ranges_come_from_the_declarations(capsys):
    ranges = flag_ranges()
    assert ranges["num_frames"] is AT_LEAST_1 and ranges["diffusion_guidance_scale_2"].low == 0
    assert not {"num_frames", "diffusion_guidance_scale_2"} & set(FLAG_RANGES)  # not kept in the shared table too
    with pytest.raises(SystemExit):
        parse_args([*BASE, "--num-frames", "0"])
    assert "--num-frames must be ≥ 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args([*BASE, "--diffusion-guidance-scale-2", "-0.5"])
    assert "--diffusion-guidance-scale-2 must be ≥ 0, got -0.5" in capsys.readouterr().err


def test_the_run_flags_become_the_family_constructor_options():
    args = parse_args([*BASE, "--num-frames", "9", "--wan-trained-experts", "low-noise"])
    assert family_options(args) == {"num_frames": 9, "trained_experts": "low-noise"}
    args = parse_args([*BASE, "--diffusion-guidance-scale-2", "2.5"])
    assert family_options(args) == {"guidance_scale_2": 2.5}
    assert family_options(parse_args(BASE)) == {}


def test_families_that_disagree_on_a_shared_flag_are_an_error(monkeypatch):
    clash = FamilyOption("cogvideox", "num_frames", "--num-frames", "default 49", float)
    monkeypatch.setattr("miles.models.options.FAMILY_OPTIONS", (*FAMILY_OPTIONS, clash))
    with pytest.raises(
        ValueError,
        match=r"--num-frames: the families \['wan', 'wan-i2v', 'hunyuan-video15', 'ltx2', 'cogvideox'\] declare it",
    ):
        add_family_arguments(argparse.ArgumentParser())


def test_parsing_the_flags_imports_no_family():
    code = (
        "import sys\n"
        "from miles.arguments.parser import parse_args\n"
        "parse_args(['--hf-checkpoint', 'builtin:tiny-wan', '--num-frames', '5'])\n"
        "print(sorted(m for m in sys.modules if m == 'diffusers' or m.startswith('miles.models.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    # the torch-free tables only (the learned shapes rewards' weight folders: what --shapes-learned-dir may name)
    assert out.stdout.strip() == (
        "['miles.models.builtin', 'miles.models.options', 'miles.models.registry', 'miles.models.shapes_reward', "
        "'miles.models.shapes_reward.weights']"
    )
