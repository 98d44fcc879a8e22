"""Colocated engines and trainer ranks on GPUs take turns holding the memory (`--colocate-sleep`).

Per rollout, with the phases of the driver's `run_rollout` (`train_diffusion.py`):

    engines generate  (trainer ranks asleep: weights, optimizer state, shadows in host memory)
    -> `to_train`:    engines sleep, dropping the trained weights the next sync replaces; trainer ranks wake
    ranks train, save when due, export the engines' weights into the object store (host memory)
    -> `to_generate`: trainer ranks sleep; engines wake and load the exported weights
    engines evaluate and generate the next rollout

At start-up (`RunGroups.start`, `start`) the first sync takes the same turn: the ranks export, sleep, and only then
do the engines load, so their whole models never sit beside the ranks' awake state.

So at no point do both hold the GPU, and the weights the engines get go through host memory as they always do. Every
trainer call that needs the weights wakes its rank (and every engine call its engine), so a phase order this class
does not know (a tool, a test) costs memory, never results.
"""

from __future__ import annotations

import argparse
import logging
import time
from typing import Any

from miles.utils.distributed import uses_gpu

logger = logging.getLogger(__name__)


NOT_RANKS = ("engines", "reward_workers")  # the placement's entries that are not trainer groups


def shared_gpus(placement: dict[str, list[dict[str, Any]]]) -> set[str]:
    """The GPUs ("node/gpu") that hold both a rollout engine and a trainer rank, from the run's placement
    (`RunGroups.record_placement`: `engines`, `reward_workers` and one entry per trained role)."""

    def slots(entries: list[dict[str, Any]]) -> set[str]:
        return {f"{entry['node_id']}/{gpu}" for entry in entries for gpu in entry.get("gpus", [])}

    ranks = set().union(*(slots(entries) for role, entries in placement.items() if role not in NOT_RANKS))
    return slots(placement.get("engines", [])) & ranks


class PhaseMemory:
    """Decides whether the run colocates (`--colocate-sleep`), then moves the engines and the trainer groups in and
    out of host memory between the phases. Off: every method is a no-op."""

    def __init__(self, args: argparse.Namespace, groups: dict, engines: Any, placement: dict | None = None) -> None:
        """`placement`: where the actors run (`record_placement`), which `auto` reads on GPUs."""
        self.groups, self.engines = groups, engines
        self.enabled = self._decide(args, placement or {})
        self.seconds = 0.0  # spent in sleeps and wakes since the last `pop_seconds`
        self._logged = False

    def _decide(self, args: argparse.Namespace, placement: dict) -> bool:
        mode = args.colocate_sleep
        if mode == "off" or self.engines is None or not self.groups:
            return False
        if mode == "auto" and not uses_gpu(args):
            return False
        if mode == "on":
            logger.info("colocate sleep on: engines and trainer ranks take turns holding their device's memory")
            return True
        shared = shared_gpus(placement)
        if not shared:
            return False
        if args.async_rollout:
            logger.warning(
                "%d GPU(s) hold both an engine and a trainer rank, but --async-rollout runs generation and training "
                "at once: both keep their memory (colocate sleep off)",
                len(shared),
            )
            return False
        logger.info("colocate sleep on: %d GPU(s) hold both an engine and a trainer rank", len(shared))
        return True

    def _timed(self, what: str, steps: list[tuple[str, Any]]) -> None:
        started = time.perf_counter()
        reports = {name: step() for name, step in steps}
        self.seconds += time.perf_counter() - started
        if not self._logged or logger.isEnabledFor(logging.DEBUG):
            gib = 2**30
            moved = {
                name: sum(r["copied_bytes"] + r["discarded_bytes"] for r in rs) / gib for name, rs in reports.items()
            }
            logger.info(
                "%s in %.2fs: %s",
                what,
                time.perf_counter() - started,
                ", ".join(f"{name} {gb:.3f} GiB" for name, gb in moved.items()),
            )

    def start(self) -> None:
        """At start-up, between the first sync's export and the engines' load: the trainer ranks sleep, and the
        engines hold the device for the first generation."""
        if self.enabled:
            self._timed("trainer ranks asleep", [(f"{role} sleep", g.sleep) for role, g in self.groups.items()])

    def to_train(self, rollout_id: int | None = None) -> None:
        """`rollout_id`: the rollout an engine's failure names."""
        if self.enabled:
            steps = [("engines sleep", lambda: self.engines.sleep(discard_weights=True, rollout_id=rollout_id))]
            steps += [(f"{role} wake", g.wake) for role, g in self.groups.items()]
            self._timed("to the train phase", steps)

    def to_generate(self, rollout_id: int | None = None) -> None:
        if self.enabled:
            steps = [(f"{role} sleep", g.sleep) for role, g in self.groups.items()]
            steps.append(("engines wake", lambda: self.engines.wake(rollout_id=rollout_id)))
            self._timed("to the generate phase", steps)
            self._logged = True

    def pop_seconds(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds
