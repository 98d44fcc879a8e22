"""--config: a YAML file of flag defaults (dashes or underscores) that the command line overrides; an unknown key
suggests the flag meant."""

from __future__ import annotations

from miles.arguments.parser import parse_args
from tests.fast.arguments.test_parser import BASE, SFT, parse_error


def test_config_file_gives_defaults_and_command_line_wins(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("lr: 0.5\nmicro-batch-size: 3\nloss_type: sft_loss\ntrain-only: true\n")
    args = parse_args(BASE + ["--config", str(cfg), "--lr", "0.25"])
    assert args.lr == 0.25 and args.micro_batch_size == 3 and args.train_only


def test_config_unknown_key_suggests_the_flag(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("micro-batch-sise: 3\n")
    err = parse_error(SFT + ["--config", str(cfg)], capsys)
    assert "micro-batch-sise" in err and "did you mean --micro-batch-size" in err
