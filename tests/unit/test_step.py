"""A step's microbatch bookkeeping, as the user's loop drives it."""

from __future__ import annotations

import torch

from phoenixft.train.step import Step, StepPhase


def test_backward_records_each_microbatch_once_and_reports_it():
    seen = []
    st = Step(4, [2, 3, 5], 8, on_backward=lambda s: seen.append(list(s.done)))
    w = torch.ones(2, requires_grad=True)
    for j in st.microbatches():
        st.backward((w * (j + 1)).sum())
    assert st.done == [2, 3, 5] and seen == [[2], [2, 3], [2, 3, 5]]
    assert st.loss_sum == 2 * (3 + 4 + 6) and st.phase is StepPhase.COMPUTE
    assert torch.equal(w.grad, torch.full((2,), 13.0))


def test_a_retried_step_yields_only_what_is_left():
    st = Step(1, [0, 1], 4)
    w = torch.ones(1, requires_grad=True)
    next(iter(st.microbatches()))
    st.backward(w.sum())
    st.ids = list(st.done) + [1, 3]  # in-step recovery: its unfinished id, and 3 as well
    assert list(st.microbatches()) == [1, 3]
