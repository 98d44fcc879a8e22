"""Which runs read each flag, declared beside the flag (`ReadBy(group, readers).add_argument(...)`: by algorithm, by
another flag, by reward), and the check that refuses a flag the user set (on the command line or in --config) that
the run would not read. An undeclared flag is read by every run; an algorithm's own flags (its `add_arguments`) are
read by it and by the algorithms whose declaration lists them in `reads`. Self-contained: the parser declares and
asks; nothing here builds the parser."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from miles.algorithms import ALGORITHMS, Algorithm
from miles.arguments.config_file import dest_of
from miles.arguments.reward_spec import reward_spec_from_args

READERS = "miles_readers"  # the attribute of an argparse Action that holds its readers
EVERY_ALGORITHM_FLAG = "*"  # in `Algorithm.reads`: the hooks read any algorithm's flags (custom_loss)
_UNSET = object()


@dataclass(frozen=True)
class ByAlgorithm:
    """Read under the algorithms `test` accepts, and those whose declaration lists the flag in `reads`; `says` names
    them as a group ("with a policy ratio"). An algorithm's own flag (`owned`) is read too by one that `reads` "*",
    unless it is `exclusive` (the owner's `exclusive_flags`)."""

    test: Callable[[Algorithm], bool]
    says: str = ""
    owned: bool = False
    exclusive: bool = False

    def reads(self, algorithm: Algorithm, dest: str) -> bool:
        if self.test(algorithm):
            return True
        every = self.owned and EVERY_ALGORITHM_FLAG in algorithm.reads
        return not self.exclusive and (dest in algorithm.reads or every)

    def refusal(self, action: argparse.Action, algorithm: Algorithm, args: argparse.Namespace) -> str | None:
        if self.reads(algorithm, action.dest):
            return None
        readers = ", ".join(a.name for a in ALGORITHMS.values() if self.reads(a, action.dest)) or "none registered"
        who = f"the algorithms {self.says} ({readers})" if self.says else f"--loss-type {readers}"
        return f"{flag_of(action)} is read only by {who}; --loss-type {algorithm.name} ignores it: drop it"


@dataclass(frozen=True)
class ByFlag:
    """Read only when another flag turns on what reads it (`--lora-rank` with `--use-lora`)."""

    dest: str
    says: str = ""  # the condition in words when it is not "--<dest> given" (e.g. "--max-restarts N above 0")

    def refusal(self, action: argparse.Action, algorithm: Algorithm, args: argparse.Namespace) -> str | None:
        if getattr(args, self.dest, None):
            return None
        flag = flag_of(action)
        needed = self.says or "--" + self.dest.replace("_", "-")
        return f"{flag} is read only with {needed}, which this run does not set: add it or drop {flag}"


@dataclass(frozen=True)
class ByReward:
    """Read only by the rewards `names` (in --rm-type)."""

    names: tuple[str, ...]

    def refusal(self, action: argparse.Action, algorithm: Algorithm, args: argparse.Namespace) -> str | None:
        flag = flag_of(action)
        try:
            rewards = [name for name, _ in reward_spec_from_args(args)]
        except ValueError:
            return None  # the spec's own rule names what is wrong with it
        if set(rewards) & set(self.names):
            return None
        wanted = " or ".join(self.names)
        return (
            f"{flag} is read only by the {wanted} reward; this run's rewards are {', '.join(rewards)}: add {wanted} "
            f"to --rm-type or drop {flag}"
        )


Readers = ByAlgorithm | ByFlag | ByReward
WITH_POLICY_RATIO = ByAlgorithm(lambda a: a.log_prob_ratio, "with a policy ratio")
WITH_FIRST_WINDOW_GUARD = ByAlgorithm(lambda a: a.first_window_metrics is not None, "with the first-window guard")
WITH_SDE_SAMPLES = ByAlgorithm(lambda a: a.samples_sde, "that sample SDE trajectories")


def read_by(action: argparse.Action, readers: Readers) -> argparse.Action:
    """Declare which runs read the flag `action` (what `group.add_argument` returned); returns it."""
    setattr(action, READERS, readers)
    return action


@dataclass(frozen=True)
class ReadBy:
    """An argument group whose `add_argument` declares each flag it adds as read by `readers`:
    `lora = ReadBy(group, ByFlag("use_lora")); lora.add_argument("--lora-rank", ...)`."""

    group: argparse._ActionsContainer
    readers: Readers

    def add_argument(self, *names: str, **kwargs: Any) -> argparse.Action:
        return read_by(self.group.add_argument(*names, **kwargs), self.readers)


def readers_of(action: argparse.Action) -> Readers | None:
    """The flag's declared readers (None: every run reads it)."""
    return getattr(action, READERS, None)


def mark_owned(actions: Iterable[argparse.Action], owner: Algorithm) -> None:
    """An algorithm's own flags: read by it, and by the algorithms that list them in `reads` unless they are its
    `exclusive_flags` (a flag with its own declaration keeps it)."""
    name = owner.name
    for action in actions:
        if readers_of(action) is None:
            exclusive = action.dest in owner.exclusive_flags
            read_by(action, ByAlgorithm(lambda a: a.name == name, owned=True, exclusive=exclusive))


def given_dests(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None, config: Mapping[Any, Any] | None = None
) -> set[str]:
    """The dests the user set: on the command line (parsed again over a namespace where nothing is set yet, so
    argparse's defaults do not count) or as --config keys."""
    dests = {action.dest for action in parser._actions}
    # appending actions extend what the namespace holds: they start from None, any value means given
    appending = {a.dest for a in parser._actions if isinstance(a, argparse._AppendAction | argparse._ExtendAction)}
    start = {dest: None if dest in appending else _UNSET for dest in dests}
    seen, _ = parser.parse_known_args(argv, namespace=argparse.Namespace(**start))
    given = {dest for dest in dests if getattr(seen, dest) is not start[dest]}
    return given | {dest_of(k) for k in config or {}}


def flag_of(action: argparse.Action) -> str:
    return next((s for s in action.option_strings if s.startswith("--")), action.option_strings[0])


def unread_flags(parser: argparse.ArgumentParser, given: set[str], args: argparse.Namespace) -> list[str]:
    """One line per flag the user set that this run does not read (empty: every given flag is read). An unknown
    --loss-type is left to the rules, which name it."""
    algorithm = ALGORITHMS.get(args.loss_type)
    if algorithm is None:
        return []
    problems = []
    for action in parser._actions:
        readers = readers_of(action)
        if action.dest in given and readers is not None and action.option_strings:
            problem = readers.refusal(action, algorithm, args)
            if problem is not None and problem not in problems:
                problems.append(problem)
    return problems
