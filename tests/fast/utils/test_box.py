"""Box (miles/utils/box.py): Ray resolves only an ObjectRef passed at the top level of a call; a boxed one reaches
the callee as a ref, fetched where it is needed (`Box.get`), while a bare one arrives as its value."""

from __future__ import annotations

import pytest

from miles.utils.box import Box, put_box

TIMEOUT = 60


def test_a_boxed_ref_reaches_the_callee_unresolved_and_a_bare_one_resolved(ray_cluster):
    ray = ray_cluster

    @ray.remote(num_cpus=0)
    def arrived(value):
        inner = value.inner if isinstance(value, Box) else value
        return isinstance(inner, ray.ObjectRef), value.get(timeout=TIMEOUT) if isinstance(value, Box) else value

    box = put_box([1, 2, 3])
    assert isinstance(box.inner, ray.ObjectRef) and box.get(timeout=TIMEOUT) == [1, 2, 3]
    assert ray.get(arrived.remote(box), timeout=TIMEOUT) == (True, [1, 2, 3])
    assert ray.get(arrived.remote(box.inner), timeout=TIMEOUT) == (False, [1, 2, 3])
    with pytest.raises(AttributeError):
        box.inner = None  # frozen: a box always holds the ref it was made with
