"""Box: carries an ObjectRef through Ray calls without Ray resolving it on the way."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Box:
    """Ray resolves only top-level ObjectRef arguments; a boxed ref reaches the callee unresolved."""

    inner: Any

    def get(self, timeout: float | None = None) -> Any:
        import ray

        return ray.get(self.inner, timeout=timeout)


def put_box(value: Any) -> Box:
    import ray

    return Box(ray.put(value))
