"""The family contract suite's fixture: every family configuration of FAMILY_CASES with its tiny folder."""

from __future__ import annotations

import pytest

from tests.fast.models.family_cases import FAMILY_CASES, case_params


@pytest.fixture(params=case_params(FAMILY_CASES), ids=[case.id for case in FAMILY_CASES])
def family_case(request):
    """(case, pipeline folder) for every family configuration of FAMILY_CASES."""
    return request.param, request.getfixturevalue(request.param.fixture)


@pytest.fixture(scope="module")
def sp_group_of_one():
    """A sequence-parallel group of one rank on a gloo world of one, for a module's tests (torn down after it): the
    all-to-alls and gathers run for real and are the identity, so a sharded transformer must compute what the plain
    one does."""
    from datetime import timedelta

    import torch.distributed as dist

    from miles.models.sequence_parallel import SequenceParallelGroup
    from miles.utils.distributed import destroy_process_group, find_free_port, init_process_group

    init_process_group(0, 1, "127.0.0.1", find_free_port(), "cpu", timeout=timedelta(seconds=60))
    yield SequenceParallelGroup(dist.group.WORLD, 1, 0)
    destroy_process_group()
