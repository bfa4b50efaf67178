"""The engine check's verdict over several engines (``rlcore.weight_sync.logprob_check``): the worst comparison
decides, and an engine whose logprobs are NaN is the worst of all (a NaN compares false with any tolerance)."""
import math

import pytest

from rlcore.errors import RlcoreError
from rlcore.weight_sync.logprob_check import LogprobComparison, raise_if_disagree, worst

CLOSE, FAR = LogprobComparison(1e-6, 1e-7, 4), LogprobComparison(3e-3, 1e-4, 4)
BROKEN = LogprobComparison(math.nan, math.nan, 4)


def test_the_largest_difference_is_the_worst():
    assert worst([CLOSE, FAR]) is FAR and worst([FAR, CLOSE]) is FAR


@pytest.mark.parametrize("order", [[BROKEN, CLOSE], [CLOSE, BROKEN, FAR], [FAR, BROKEN]])
def test_a_nan_engine_is_the_worst_and_fails_the_check(order):
    assert worst(order) is BROKEN
    with pytest.raises(RlcoreError, match="disagree after a weight sync"):
        raise_if_disagree(worst(order), tolerance=1.0)
