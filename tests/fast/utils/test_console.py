"""The console: unactionable third-party warnings dropped, progress numbers that move, the closing summary line."""

from __future__ import annotations

import argparse
import io
import logging
import os

from miles.algorithms import get_algorithm
from miles.utils.console import (
    WORKER_ENV,
    ProgressLine,
    TqdmHandler,
    _DropMessages,
    engine_progress_display,
    quiet_third_party,
    ray_init_kwargs,
    setup_logging,
    summary_line,
)


def test_the_torchvision_fallback_warning_is_dropped_and_other_transformers_warnings_are_kept():
    # `import miles` (done by this file's imports) installed the filter: every Ray worker has it without a hook
    assert any(isinstance(f, _DropMessages) for f in logging.getLogger("transformers.utils.import_utils").filters)
    quiet_third_party()
    quiet_third_party()  # idempotent: one filter
    logger = logging.getLogger("transformers.utils.import_utils")
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger.addHandler(handler)
    try:
        logger.warning(
            "`CLIPImageProcessor` requires torchvision (not installed); falling back to `CLIPImageProcessorPil`"
        )
        logger.warning("some other import problem")
    finally:
        logger.removeHandler(handler)
    assert stream.getvalue() == "some other import problem\n"
    assert len(logger.filters) == 1


def test_a_local_cluster_gets_the_worker_env_through_the_driver_and_no_runtime_env(monkeypatch):
    for name in WORKER_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TQDM_DISABLE", "0")  # what the user set stays
    local = ray_init_kwargs(local=True)
    assert "runtime_env" not in local  # a runtime env costs each worker a second Python start
    assert {name: os.environ[name] for name in WORKER_ENV} == {**WORKER_ENV, "TQDM_DISABLE": "0"}
    remote = ray_init_kwargs(local=False)  # other nodes' workers do not inherit this process's environment
    assert remote["runtime_env"] == {"env_vars": WORKER_ENV}
    assert local["logging_level"] == remote["logging_level"] == logging.WARNING


def test_progress_shows_what_moves_and_keeps_the_last_eval():
    line = ProgressLine(get_algorithm("policy_loss").progress_keys)  # the keys its declaration names
    train = {"role": "actor", "train/loss": 0.0, "train/approx_kl": 0.0, "train/clipfrac": 0.0, "train/grad_norm": 0.5}
    first = line.update([train, {"rollout/reward_mean": 0.8, "eval/shapes_accuracy": 0.5}])
    assert first == {"acc": "0.500", "reward": "0.800", "grad": "0.500"}  # zeros since the start are left out
    second = line.update([{**train, "train/approx_kl": 2e-3}, {"rollout/reward_mean": 0.9}])
    assert second == {"acc": "0.500", "reward": "0.900", "approx_kl": "2.00e-03", "grad": "0.500"}
    assert "loss" not in line.update([{**train, "train/approx_kl": 0.0}])  # once moved, a key stays shown
    assert line.update([])["approx_kl"] == "0.00e+00"


def test_the_bar_label_carries_the_engines_progress_while_a_generation_is_awaited():
    from tqdm import tqdm

    with tqdm(range(3), desc="nft", file=io.StringIO()) as bar:
        display = engine_progress_display(bar, "nft")
        display("generate 37/80 steps")
        assert bar.desc == "nft [generate 37/80 steps]"
        display("")
        assert bar.desc == "nft"


def test_summary_line_says_time_eval_gain_and_where_things_are():
    args = argparse.Namespace(output_dir="out/run", eval_num_prompts=500, save="ckpt", save_hf=None)
    records = [
        {"rollout_id": 0, "eval/shapes_accuracy": 0.42},
        {"rollout_id": 0, "rollout/reward_mean": 0.8},
        {"rollout_id": 39, "eval/shapes_accuracy": 0.54},
    ]
    line = summary_line(args, records, 275.0, "out/run/metrics.png")
    assert line == (
        "done in 4 min 35 s; eval accuracy on 500 held-out prompts: 0.420 -> 0.540; "
        "outputs in out/run/ (metrics.jsonl, train.log, images/); plot out/run/metrics.png; checkpoints in ckpt"
    )
    assert summary_line(args, [], 2.25).startswith("done in 2.2 s; outputs in out/run/")


def test_log_lines_go_through_tqdm_write():
    stream = io.StringIO()
    handler = TqdmHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logger = logging.getLogger("miles.test_console")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("hello")
    finally:
        logger.removeHandler(handler)
    assert stream.getvalue() == "WARNING hello\n"


def test_the_drivers_log_goes_to_train_log_with_the_default_notes_first(tmp_path):
    root, before = logging.getLogger(), logging.getLogger().handlers[:]
    try:
        setup_logging(str(tmp_path / "out"), "INFO", ["--dp-size auto: 2", "--micro-batch-size auto: 4"])
        logging.getLogger("miles.test").debug("below the level")
        logging.getLogger("miles.test").info("a line")
        assert any(isinstance(h, TqdmHandler) for h in root.handlers) and root.level == logging.INFO
        for handler in root.handlers:
            handler.flush()
        lines = (tmp_path / "out" / "train.log").read_text().splitlines()
    finally:
        for handler in root.handlers:
            handler.close()
        logging.basicConfig(handlers=before, force=True)
    assert [line.split(": ", 1)[1] for line in lines] == ["--dp-size auto: 2", "--micro-batch-size auto: 4", "a line"]
    assert " INFO miles.driver: " in lines[0]
