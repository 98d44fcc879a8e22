"""The records of an algorithm's rollout side: `RolloutSpec` (engine-fed: request, samples -> train pairs) and
`DatasetSpec` (dataset-fed: records encoded once). What the declaration in `miles/algorithms/` says (rewards scored,
SDE sampling, engines used) is asked of it, not repeated here."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from miles.rollout.engine_api import GenerateRequest
from miles.rollout.requests import ode_eval
from miles.utils.types import TrainPairs

RequestFn = Callable[..., GenerateRequest]  # (args, samples, *, rollout_id, resolution) -> GenerateRequest
ConvertFn = Callable[..., TrainPairs]  # (args, samples, result, advantages, *, rollout_id) -> TrainPairs
PairsPerSampleFn = Callable[..., int]  # (args, request) -> pairs per sample, sample-major in the converted pairs
EncodeFn = Callable[..., TrainPairs]  # (args, family, records, *, resolution) -> TrainPairs, row i from records[i]
RecordsFn = Callable[..., list[dict[str, Any]]]  # (args, *, resolution) -> records, each a dict with at least "prompt"


def no_metrics(request: GenerateRequest) -> dict[str, Any]:
    return {}


def no_stale_batch_conflict(args: argparse.Namespace) -> str | None:
    return None


@dataclass(frozen=True)
class DatasetSpec:
    """An algorithm that trains on (prompt, image) records instead of generated samples: `encode` turns every record
    (loaded with its image at the run's resolution) into train pairs once, at start-up, with the encoders it loads
    itself; each rollout then trains the rows the data source picks (`PromptDataSource.indices`). No engine starts,
    no reward is scored, nothing is generated (so --async-rollout and the held-out eval have nothing to work on).

    `records`: where the records come from when they are not --prompt-data's (prompt, image) records (None), e.g.
    a file of preference pairs its own flag names and its declaration's rules validated at parse time."""

    encode: EncodeFn
    records: RecordsFn | None = None


@dataclass(frozen=True)
class RolloutSpec:
    """An algorithm whose rollouts the engines generate.

    - `build_request`: the engines' request for one rollout's samples; `convert`: samples -> train pairs;
      `pairs_per_sample`: how many consecutive (sample-major) pairs `convert` makes of each sample.
    - `metrics`: rollout metrics read from the request (e.g. dmd2's trained generator step).
    - `eval_sampler`: the sampler keywords of the held-out eval (the deterministic ODE by default).
    - `stale_batch`: --async-rollout: what the loss does with a batch generated one update behind the trainer (None:
      it is not known to be right, and --async-rollout is refused); `stale_batch_conflict`: the flags with which it
      would be wrong (an error message, or None).
    - `dataset`: what a --train-only run of this loss type trains on instead (None: --train-only is refused).
    Whether rewards are scored is the declaration's `scores_rewards` (`miles.algorithms.algorithm_of(args)`).
    """

    build_request: RequestFn
    convert: ConvertFn
    pairs_per_sample: PairsPerSampleFn
    metrics: Callable[[GenerateRequest], dict[str, Any]] = no_metrics
    eval_sampler: Callable[[argparse.Namespace], dict[str, Any]] = ode_eval
    stale_batch: str | None = None
    stale_batch_conflict: Callable[[argparse.Namespace], str | None] = no_stale_batch_conflict
    dataset: DatasetSpec | None = None
