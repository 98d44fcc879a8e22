"""sft_loss: flow-matching supervised fine-tuning on (prompt, image) dataset pairs."""

from __future__ import annotations

from miles.algorithms.base import COMMON_PANELS, Algorithm

ALGORITHM = Algorithm(
    name="sft_loss",
    scores_rewards=False,
    samples_sde=False,
    uses_engines=False,
    progress_keys=(("loss", "train/loss", ".4f"), ("lr", "train/lr", ".1e")),
    plot_panels=(("flow-matching loss", ("train/loss",)), ("learning rate", ("train/lr",)), *COMMON_PANELS),
)
