"""The picture of a run: the loss type's panels from metrics.jsonl, a PNG beside it, the CLI."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from miles.algorithms import ALGORITHMS, Algorithm, register_algorithm
from miles.plot import infer_loss_type, main, plot_panels, plot_run, running_mean
from miles.utils.tracking import MetricsWriter


def nft_records(rollouts: int = 4) -> list[dict]:
    records = [{"rollout_id": 0, "step": 0, "eval/shapes_accuracy": 0.42, "eval/rollouts_trained": 0}]
    for r in range(rollouts):
        records.append(
            {
                "role": "actor",
                "rollout_id": r,
                "step": r + 1,
                "train/loss": 4.0 - r / 10,
                "train/nft_policy_loss": 4.0,
                "train/grad_norm": 1.0,
                "train/lr": 1e-4,
            }
        )
        records.append(
            {
                "rollout_id": r,
                "step": r + 1,
                "rollout/reward_mean": 0.8 + r / 100,
                "perf/rollout_s": 2.0,
                "perf/train_s": 3.0,
            }
        )
    records[-1].update({"eval/shapes_accuracy": 0.5, "eval/rollouts_trained": rollouts})
    return records  # fmt: skip


def test_the_loss_type_is_read_from_the_metrics_it_logged():
    assert infer_loss_type(nft_records()) == "nft"
    assert infer_loss_type([{"role": "actor", "train/ratio_mean": 1.0, "rollout/reward_mean": 0.5}]) == "policy_loss"
    assert infer_loss_type([{"role": "critic", "train/critic_loss": 1.0}]) == "dmd2"
    assert infer_loss_type([{"role": "actor", "train/loss": 1.0, "step": 1}]) == "sft_loss"


def test_a_run_no_declaration_recognises_gets_the_default_panels():
    records = [
        {"role": "actor", "step": 1, "train/loss": 1.0, "train/grad_norm": 0.5},
        {"rollout_id": 0, "step": 1, "rollout/reward_mean": 0.2},
    ]
    assert infer_loss_type(records) is None
    assert [title for title, _ in plot_panels(records, None)] == ["rollout reward", "loss", "grad norm"]


def test_a_registered_plugin_is_recognised_and_drawn_with_its_own_panels():
    saved = dict(ALGORITHMS)
    try:
        register_algorithm(
            Algorithm(name="plugged", identifying_metrics=("train/plugged",), plot_panels=(("P", ("train/plugged",)),))
        )
        records = [{"role": "actor", "step": 1, "train/plugged": 1.0, "train/loss": 2.0}]
        assert infer_loss_type(records) == "plugged"
        assert plot_panels(records, "plugged") == [("P", ("train/plugged",))]
    finally:
        ALGORITHMS.clear()
        ALGORITHMS.update(saved)


def test_panels_are_those_of_the_loss_type_that_the_run_logged():
    titles = [title for title, _ in plot_panels(nft_records(), "nft")]
    assert titles == ["rollout reward", "held-out accuracy", "NFT loss", "grad norm", "seconds per rollout"]
    assert dict(plot_panels(nft_records(), "nft"))["seconds per rollout"] == ("perf/rollout_s", "perf/train_s")


def test_monitor_panels_expand_patterns_and_skip_a_kl_the_algorithm_already_draws():
    records = [
        {"role": "actor", "step": 1, "train/ratio_mean": 1.0, "train/clipfrac": 0.0, "train/kl": 0.01},
        {
            "rollout_id": 0,
            "step": 1,
            "rollout/reward_mean": 0.5,
            "rollout/reward_shapes_mean": 0.4,
            "rollout/reward_custom_mean": 0.6,
            "rollout/reward_std": 0.1,
            "monitor/reward_corr/shapes__custom": -0.3,
            "monitor/x0_brightness_mean": 0.5,
            "monitor/x0_norm_mean": 1.1,
            "monitor/diversity_pixel": 0.2,
        },
    ]
    panels = dict(plot_panels(records, "policy_loss"))
    assert panels["reward components"] == ("rollout/reward_custom_mean", "rollout/reward_shapes_mean")
    assert panels["reward correlations"] == ("monitor/reward_corr/shapes__custom",)
    assert panels["decoded brightness / saturation"] == ("monitor/x0_brightness_mean",)
    assert panels["diversity within prompt groups"] == ("monitor/diversity_pixel",)
    assert "KL to reference" not in panels and "train/kl" in panels["KL / clip fraction"]
    assert dict(plot_panels(records, None))["KL to reference"] == ("train/kl",)  # no other panel draws it


def test_a_guarded_run_draws_its_proxy_and_gold_and_the_guards_actions():
    records = nft_records()
    records[0].update({"eval/proxy_reward": 0.9, "eval/gold_reward": 0.86})
    records[-1].update(
        {"eval/proxy_reward": 0.95, "eval/gold_reward": 0.8, "monitor/tripped": 1, "monitor/rollbacks": 1}
    )
    panels = dict(plot_panels(records, "refl"))
    assert panels["held-out proxy and gold (--gold-rm-type)"] == ("eval/proxy_reward", "eval/gold_reward")
    assert panels["guard (--monitor-action)"] == ("monitor/tripped", "monitor/rollbacks")
    assert "guard (--monitor-action)" not in dict(plot_panels(nft_records(), "nft"))


def test_the_plot_is_a_png_beside_metrics_jsonl(tmp_path):
    writer = MetricsWriter(str(tmp_path))
    for record in nft_records():
        writer.log(record)
    writer.close()
    path = plot_run(str(tmp_path))
    assert path == str(tmp_path / "metrics.png")
    image = np.asarray(Image.open(path).convert("L"))
    assert image.shape[0] > 200 and image.shape[1] > 600 and image.std() > 10  # drawn, not blank


def test_the_cli_names_a_missing_metrics_file(tmp_path, caplog):
    assert main([str(tmp_path)]) == 1
    assert str(tmp_path / "metrics.jsonl") in caplog.text


def test_the_cli_writes_the_plot(tmp_path):
    writer = MetricsWriter(str(tmp_path))
    for record in nft_records(2):
        writer.log(record)
    writer.close()
    assert main([str(tmp_path), "--loss-type", "nft"]) == 0
    assert (tmp_path / "metrics.png").stat().st_size > 0
    with pytest.raises(SystemExit):
        main([str(tmp_path), "--loss-type", "ppo"])


def test_running_mean_averages_the_last_window_values():
    assert running_mean([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert running_mean([2.0, 4.0], 5) == [2.0, 3.0]


def test_the_overoptimisation_figure_reads_the_evals_and_marks_rollbacks(tmp_path):
    """scripts/plot_overoptimisation.py: proxy, gold and accuracy per eval, a rollback marked; a run without the gold
    is named."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "plot_overoptimisation.py"
    spec = importlib.util.spec_from_file_location("plot_overoptimisation", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    records = [
        {"eval/rollouts_trained": 0, "eval/proxy_reward": 0.8, "eval/gold_reward": 0.8, "eval/shapes_accuracy": 0.4},
        {"rollout_id": 9, "monitor/rollback_to": 4, "monitor/rollbacks": 1},
        {"eval/rollouts_trained": 10, "eval/proxy_reward": 0.9, "eval/gold_reward": 0.7},
    ]
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    series = script.run_series(str(run))
    assert series[script.PROXY] == [(0, 0.8), (10, 0.9)] and series[script.GOLD] == [(0, 0.8), (10, 0.7)]
    assert series[script.ACCURACY] == [(0, 0.4)] and series[script.ROLLBACK_TO] == [(9, 4.0)]
    assert script.main([str(run), "--labels", "a, with commas", "--out", str(tmp_path / "p.png")]) == 0
    assert Image.open(tmp_path / "p.png").size[0] > 100
    (run / "metrics.jsonl").write_text(json.dumps({"eval/rollouts_trained": 0, "eval/shapes_accuracy": 0.4}) + "\n")
    with pytest.raises(ValueError, match="needs --gold-rm-type"):
        script.run_series(str(run))
