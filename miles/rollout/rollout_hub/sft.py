"""sft_loss, rollout side: the (prompt, image) records encoded once into dataset pairs (`rollout_hub/dataset.py`)."""

from __future__ import annotations

from miles.rollout.rollout_hub.dataset import DATASET_SPEC

SPEC = DATASET_SPEC
