"""The family contract suite's fixture: every family configuration of FAMILY_CASES with its tiny folder."""

from __future__ import annotations

import pytest

from tests.fast.models.family_cases import FAMILY_CASES, case_params


@pytest.fixture(params=case_params(FAMILY_CASES), ids=[case.id for case in FAMILY_CASES])
def family_case(request):
    """(case, pipeline folder) for every family configuration of FAMILY_CASES."""
    return request.param, request.getfixturevalue(request.param.fixture)
