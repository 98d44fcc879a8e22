"""An algorithm declared by --algorithm-path (examples/critic_filtered_fm.py: a critic role, a flag of its own) trains
through the driver at dp size 2 (its hooks run in the trainer actors, its rollout entry in the driver) and resumes; one declared without hub entries fails before any actor starts
(one not even declared fails at parse time: tests/fast/test_examples.py)."""

import shutil
from pathlib import Path

import pytest

import train_diffusion
from miles.arguments.parser import parse_args
from miles.utils.tracking import read_metrics

pytestmark = pytest.mark.e2e
EXAMPLE = str(Path(__file__).parents[2] / "examples" / "advantage_weighted_fm.py")


def plugin_argv(out, loss_type="awfm", plugin=EXAMPLE):
    return [
            "--algorithm-path", plugin, "--loss-type", loss_type, "--hf-checkpoint", "builtin:tiny-shapes",
            "--prompt-data", "builtin:shapes", "--dp-size", "2", "--num-rollout", "1", "--rollout-batch-size", "4",
            "--n-samples-per-prompt", "4", "--diffusion-num-steps", "4", "--diffusion-guidance-scale", "1.0",
            "--micro-batch-size", "4", "--eval-interval", "0", "--image-grid-interval", "0", "--output-dir", str(out),
            "--no-progress", "--log-level", "WARNING",
    ]  # fmt: skip


def plugin_args(out, loss_type="awfm", plugin=EXAMPLE):
    return parse_args(plugin_argv(out, loss_type, plugin))


def test_a_loss_type_without_entries_fails_before_any_actor(ray_cluster, tmp_path):
    declared_only = tmp_path / "declared_only.py"
    declared_only.write_text(
        "from miles.algorithms import Algorithm, register_algorithm\n\nregister_algorithm(Algorithm(name='nope'))\n"
    )
    with pytest.raises(ValueError, match="no loss hooks registered for --loss-type nope"):
        train_diffusion.run(plugin_args(tmp_path, loss_type="nope", plugin=str(declared_only)))


CRITIC_EXAMPLE = str(Path(__file__).parents[2] / "examples" / "critic_filtered_fm.py")


def critic_plugin_argv(out, *extra):
    return plugin_argv(out, loss_type="cffm", plugin=CRITIC_EXAMPLE) + [
        "--critic-lr", "3e-4", "--cffm-temperature", "0.5", "--save-interval", "1", *extra,
    ]  # fmt: skip


def test_a_plugin_with_a_critic_role_trains_resumes_and_locks_its_critic_folder(ray_cluster, tmp_path):
    """examples/critic_filtered_fm.py: its critic trains first with its own lr into its own save folder (locked for
    the run), the actor reads the critic's train output; a run resumed from both folders continues the uninterrupted
    run's metric series bit for bit."""
    from miles.algorithms import algorithm_of
    from miles.ray.checkpoint_folders import lock_save_folders
    from miles.utils.locks import FolderLockedError

    def run(out, num_rollout, *extra):
        saves = ["--save", str(out / "actor"), "--critic-save", str(out / "critic")]
        return parse_args([*critic_plugin_argv(out / "run", *saves, *extra), "--num-rollout", str(num_rollout)])

    whole = run(tmp_path / "whole", 2)
    assert algorithm_of(whole).role_names == ["critic", "actor"] and whole.critic_lr == 3e-4

    def second_run_is_refused(groups):
        with pytest.raises(FolderLockedError, match="--critic-save"):
            lock_save_folders(whole)

    train_diffusion.run(whole, before_shutdown=second_run_is_refused)
    records = read_metrics(tmp_path / "whole" / "run" / "metrics.jsonl")
    critic = [m for m in records if m.get("role") == "critic"]
    actor = [m for m in records if m.get("role") == "actor"]
    assert len(critic) == len(actor) == 2
    assert all(m["train/lr"] == 3e-4 for m in critic) and all(m["train/lr"] == 1e-4 for m in actor)
    assert all(0 < m["train/critic_filter_mean"] <= 1 and 0 < m["train/imitated_frac"] < 1 for m in actor)
    assert all(m["train/loss"] > 0 and m["train/grad_norm"] > 0 for m in critic + actor)
    assert (tmp_path / "whole" / "critic" / "latest_checkpointed_iteration.txt").is_file()

    for role in ("actor", "critic"):  # the folders as a run stopped after rollout 0 left them
        shutil.copytree(tmp_path / "whole" / role / "iter_0000000", tmp_path / "resumed" / role / "iter_0000000")
        (tmp_path / "resumed" / role / "latest_checkpointed_iteration.txt").write_text("0")
    resumed = run(tmp_path / "resumed", 2, "--load", str(tmp_path / "resumed" / "actor"))
    assert resumed.critic_load == str(tmp_path / "resumed" / "critic")  # the critic resumes from its own folder
    train_diffusion.run(resumed)

    def rollout_1(path):
        return [
            {k: v for k, v in m.items() if not k.startswith("perf/")}
            for m in read_metrics(path)
            if m.get("rollout_id") == 1
        ]

    expected = rollout_1(tmp_path / "whole" / "run" / "metrics.jsonl")
    assert [m.get("role") for m in expected] == ["critic", "actor", None]
    assert rollout_1(tmp_path / "resumed" / "run" / "metrics.jsonl") == expected
