"""ReCoVer quota plans."""

from __future__ import annotations

import pytest


def test_quota_plans():
    from phoenixft.train.quota import effective_m, plan, reassign
    assert plan(8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert plan(8, 3) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert sorted(j for ids in plan(7, 5) for j in ids) == list(range(7))
    # a spare keeps its rank's ids; a shrink deals the orphans to the least loaded
    assert reassign([4, 5], plan(8, 4), 4) == [[], [], [4, 5], []]
    assert reassign([6, 7], plan(8, 4), 3) == [[6], [7], []]
    assert effective_m(8, 4, 3, "constant") == 8 and effective_m(8, 4, 3, "shrink-batch") == 6
    with pytest.raises(ValueError):
        effective_m(8, 4, 3, "bogus")
