"""The named layout of the per-step all-reduce buffer."""

from __future__ import annotations

from phoenixft.train.reduce_layout import ReduceLayout


def test_fields_are_disjoint_and_fill_the_buffer():
    lay = ReduceLayout(size=10, m=4)
    cells = list(range(10))[lay.grads] + list(range(lay.total))[lay.mask]
    cells += [lay.grow, lay.loss, lay.count]
    assert sorted(cells) == list(range(lay.total)) == list(range(17))
    assert ReduceLayout.capacity(10, 6) >= ReduceLayout(10, 6).total > lay.total


def test_the_times_and_the_stalls_take_one_slot_per_rank_after_the_tail():
    lay = ReduceLayout(size=10, m=4, world=3)
    assert lay.times == slice(17, 20) and lay.stalls == slice(20, 23) and lay.total == 23
    assert ReduceLayout.capacity(10, 4, 3) == lay.total
