"""Sampled recomputation's verdict on known digests: each checked microbatch is computed
three times, and the rank outside the majority is named, whichever of the three it is."""

from phoenixft.train.recompute import NONE, checks_of, judge, ring


def _tally(world: int, wrong: set[int] = frozenset(), own_only: set[int] = frozenset()):
    """Digests as ranks compute them: microbatch of rank a has the value 100 + a; a rank in
    `wrong` computes everything off by 1, one in `own_only` only its own."""
    def computed(by: int, of: int) -> int:
        off = by in wrong or (by in own_only and by == of)
        return 100 + of + (1 if off else 0)
    order = list(range(world))
    return [[computed(r, r), *(computed(r, p) for p in checks_of(r, order))]
            for r in range(world)]


def test_each_rank_checks_the_two_before_it_with_the_nodes_interleaved():
    assert checks_of(0, [0, 1, 2, 3]) == [3, 2] and checks_of(2, [0, 1, 2, 3]) == [1, 0]
    # 3 nodes of 2 ranks: each microbatch is recomputed on the two other nodes
    nodes = {0: 0, 1: 0, 2: 1, 3: 1, 4: 2, 5: 2}
    order = ring(nodes, 6)
    assert order == [0, 2, 4, 1, 3, 5]
    for r in range(6):
        assert sorted(nodes[c] for c in checks_of(r, order)) == sorted({0, 1, 2} - {nodes[r]})
    assert ring({}, 3) == [0, 1, 2]  # one node


def test_nobody_is_named_when_every_computation_agrees():
    assert judge(_tally(4), [0, 1, 2, 3]) == ({}, [])


def test_a_rank_whose_arithmetic_is_off_is_named_for_its_own_and_its_checks():
    named, undecided = judge(_tally(4, wrong={1}), [0, 1, 2, 3])
    assert list(named) == [1] and undecided == []
    assert "rank 1's gradient of" in named[1]


def test_a_fault_in_its_own_microbatch_only_is_still_named_by_the_majority():
    named, _ = judge(_tally(3, own_only={2}), [0, 1, 2])
    assert list(named) == [2] and "its own first microbatch" in named[2]


def test_a_rank_without_microbatches_or_a_retried_step_names_nobody():
    t = _tally(4, wrong={1})
    t[1] = [NONE, NONE, NONE]  # rank 1 computed nothing checkable (a retried step)
    assert judge(t, [0, 1, 2, 3]) == ({}, [])


def test_three_different_answers_name_nobody_and_say_so():
    t = _tally(3)
    t[1][1] += 7  # rank 1's check of rank 0
    t[2][2] += 9  # rank 2's check of rank 0: rank 0's microbatch has three values
    named, undecided = judge(t, [0, 1, 2])
    assert named == {} and len(undecided) == 1 and "rank 0's first microbatch" in undecided[0]
