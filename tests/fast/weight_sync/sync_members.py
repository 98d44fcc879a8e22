"""Stand-ins for the members of a weight sync in a Ray test (a trainer rank's `push_weights`, an engine's
`receive_weights` and `progress`), each told what to do: answer, hang as in a collective whose peer died, raise the
error a broken collective raises, or die. Imports nothing heavy: each is a process of its own."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace


class SyncMember:
    def __init__(self, does: str, after_s: float = 0.0) -> None:
        self.does, self.after_s = does, after_s

    def _act(self) -> int:
        time.sleep(self.after_s)
        if self.does == "die":
            os._exit(1)  # the process is gone: Ray reports the death a little after
        if self.does == "break":  # gloo's error in a rank whose peer died mid-collective
            raise ConnectionError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:41000")
        if self.does == "hang":
            time.sleep(3600)
        return 0

    def push_weights(self) -> float:
        return float(self._act())

    def receive_weights(self, version: int) -> None:
        self._act()

    def progress(self) -> SimpleNamespace:
        return SimpleNamespace(ticks=0)
