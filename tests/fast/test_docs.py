"""Docs that must match the code."""

import json
import os
import re
import subprocess
import sys

import pytest

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


def test_the_docs_site_builds_strictly(tmp_path):
    """`mkdocs build --strict`: a broken link or anchor, or a page under docs/ missing from mkdocs.yml's nav, fails."""
    try:
        from mkdocs.commands.build import build
        from mkdocs.config import load_config
    except ImportError as e:  # a dev dependency: scripts/setup.sh installs it
        pytest.fail(f"mkdocs is not installed ({e}): pip install -e '.[dev]' (mkdocs, mkdocs-material)")
    config = load_config(os.path.join(ROOT, "mkdocs.yml"), strict=True, site_dir=str(tmp_path / "site"))
    build(config)  # raises mkdocs.exceptions.Abort on the first warning under strict
    assert (tmp_path / "site" / "index.html").is_file()


def test_readme_is_short_and_gives_the_two_commands():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    assert len(readme) < 10_000, f"README.md has {len(readme)} characters; move detail to docs/ (limit 10 000)"
    for command in ("./scripts/demo.sh", "./scripts/test.sh"):
        assert command in readme
        assert os.access(os.path.join(ROOT, command), os.X_OK), command


def test_the_readme_support_table_comes_from_the_registries(load_script):
    module = load_script("scripts/regen_results.py")
    assert module.support_table_is_current(), "run: python scripts/regen_results.py --render-only"


def test_every_regenerated_section_holds_a_regenerated_run():
    """Each `<!-- regen:NAME -->` section of the pages the script writes is filled (an empty one: never run)."""
    sections = {"README.md": 3, "docs/results.md": 1, "docs/user-guide/quick-start.md": 1}
    for path, count in sections.items():
        with open(os.path.join(ROOT, path)) as f:
            bodies = re.findall(r"<!-- regen:([\w-]+) -->\n(.*?)<!-- /regen:\1 -->", f.read(), re.DOTALL)
        assert len(bodies) == count, (path, [name for name, _ in bodies])
        assert all(body.strip() for _, body in bodies), f"{path}: empty regen section; run scripts/regen_results.py"


def test_regen_rewrites_only_between_its_markers(load_script):
    module = load_script("scripts/regen_results.py")
    text = "keep\n<!-- regen:x -->\nold\n<!-- /regen:x -->\nkeep too\n"
    assert module.replace_between(text, "x", "new\n") == "keep\n<!-- regen:x -->\nnew\n<!-- /regen:x -->\nkeep too\n"
    with pytest.raises(ValueError, match="regen:y"):
        module.replace_between(text, "y", "new")


def test_regen_reads_a_finished_run(load_script, tmp_path):
    """A run folder as `run_one` leaves it: the table carries each eval's accuracy, the gain and the eval reward."""
    module = load_script("scripts/regen_results.py")
    record = {"run": "demo", "flags": "(none: the demo)", "date_utc": "2026-12-06 12:00", "commit": "abc1234"}
    record.update(machine="2 CPU cores", wall_s=153.0, returncode=0)
    (tmp_path / "regen.json").write_text(json.dumps(record))
    evals = [(0, 0.42, 0.861), (20, 0.44, 0.87), (40, 0.504, 0.888)]
    rows = [{"eval/rollouts_trained": r, "eval/shapes_accuracy": a, "eval/shapes_reward_mean": w} for r, a, w in evals]
    rows.insert(1, {"rollout_id": 0, "rollout/reward_mean": 0.8})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    summary = f"done in 2 min 33 s; eval accuracy on 500 held-out prompts: 0.420 -> 0.504; outputs in {ROOT}/x/"
    (tmp_path / "console.txt").write_text(f"2026-12-06 12:00:00,000 INFO __main__: {summary}\n")
    run = module.summarize(str(tmp_path))
    assert (
        run["summary_line"]
        == "done in 2 min 33 s; eval accuracy on 500 held-out prompts: 0.420 -> 0.504; outputs in x/"
    )
    table = module.learning_table([run])
    assert "| before (0) | after 20 | after 40 |" in table
    assert "| 0.420 | 0.440 | 0.504 | +8.4 pts | 0.861 -> 0.888 | 153 s | 2026-12-06 12:00, abc1234 |" in table
    assert "0.420 -> 0.440 -> 0.504" in module.headline(run)
