"""Stand-ins for the members of a weight sync in a Ray test (a trainer rank's `push_weights`, an engine's
`receive_weights` and `progress`), each told what to do: answer, hang as in a collective whose peer died, raise the
error a broken collective raises, or die. Imports nothing heavy: each is a process of its own."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace


class SyncMember:
    """`does`: "answer", "hang", "break" or "die", after `after_s` seconds. With `flag` (a file path) a breaking
    member creates the file as it breaks and a dying one waits for it first: the death comes after the peer's error,
    as when a killed rank's peers see the broken connection before Ray has reported the death."""

    def __init__(self, does: str, after_s: float = 0.0, flag: str | None = None) -> None:
        self.does, self.after_s, self.flag = does, after_s, flag

    def _act(self) -> int:
        time.sleep(self.after_s)
        if self.does == "die":
            while self.flag is not None and not os.path.exists(self.flag):
                time.sleep(0.01)
            os._exit(1)  # the process is gone: Ray reports the death a little after
        if self.does == "break":  # gloo's error in a rank whose peer died mid-collective
            if self.flag is not None:
                open(self.flag, "w").close()
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
