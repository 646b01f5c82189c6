"""A blocking call run in the background (`Pending`): its result, its error, and giving
up on a newer generation or a deadline while the call still runs."""

from __future__ import annotations

import threading

import pytest

from phoenixft.comm.collectives import CommFailure, GenerationChanged, Interrupt, Pending


def test_a_pending_call_hands_over_its_value_or_its_error():
    it = Interrupt()
    it.enter(0)
    assert Pending(lambda: 42, it, "answering").result(5) == 42

    def fail():
        raise OSError("no route")
    with pytest.raises(CommFailure, match="building x failed: no route"):
        Pending(fail, it, "building x").result(5)


def test_a_pending_call_is_given_up_on_a_newer_generation_and_on_its_deadline():
    it = Interrupt()
    it.enter(3)
    release = threading.Event()
    try:
        slow = Pending(lambda: release.wait(30), it, "building generation 3's group")
        threading.Timer(0.05, it.announce, args=(4,)).start()
        with pytest.raises(GenerationChanged, match="generation 4 was published"):
            slow.result(30)
        it.enter(4)
        with pytest.raises(CommFailure, match="no progress within 0.1s"):
            Pending(lambda: release.wait(30), it, "a hung build").result(0.1)
    finally:
        release.set()


def test_a_discarded_call_releases_its_value_whether_it_came_before_or_after():
    """A group built for a generation that was superseded before anyone joined it is
    aborted, not left to spin on its dead peer's socket."""
    it = Interrupt()
    it.enter(0)
    released = []
    done = Pending(lambda: "group 1", it, "building 1")
    it.wait_until(lambda: "value" in done._box, 5, "the first build")
    done.discard(released.append)
    assert released == ["group 1"]

    gate = threading.Event()
    late = Pending(lambda: gate.wait(30) and "group 2", it, "building 2")
    late.discard(released.append)
    assert released == ["group 1"]  # not come yet
    gate.set()
    it.wait_until(lambda: len(released) == 2, 5, "the late value released")
    assert released == ["group 1", "group 2"] and "value" not in late._box
