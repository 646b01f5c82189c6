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


def test_plan_in_rounds_gives_every_place_of_a_group_as_many_ids():
    from phoenixft.train import quota
    # 6 microbatches on 2 groups of 2 (after a 3 x 2 HSDP job lost a group)
    got = quota.plan_in_rounds(6, 2, 2)
    assert got == [[0, 4], [1, 5], [2], [3]]
    assert sorted(j for ids in got for j in ids) == list(range(6))
    for u in range(2):  # the places of a group run as many passes
        assert len({len(got[u * 2 + i]) for i in range(2)}) == 1
    assert quota.plan_in_rounds(4, 2, 2) == [[0], [1], [2], [3]]


def test_a_weighted_plan_gives_a_slow_rank_its_share_and_covers_every_id():
    from phoenixft.train import quota
    assert quota.plan_weighted(12, [1, 0.25, 1]) == [[0, 1, 2, 3, 4], [5, 6], [7, 8, 9, 10, 11]]
    assert quota.plan_weighted(8, [1, 1, 1, 1]) == quota.plan(8, 4)
    got = quota.plan_weighted(7, [1, 0.1, 2])
    assert [j for ids in got for j in ids] == list(range(7))
    with pytest.raises(ValueError):
        quota.plan_weighted(4, [1, 0])
