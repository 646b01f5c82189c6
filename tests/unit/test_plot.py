"""The timeline's throughput panel shows a recovery's dip where it happened, and the
recovery as a span from detection to the first step after (observe/plot.py)."""

from phoenixft.observe.plot import plot_training, recovery_spans, step_rates


def _events():
    ev = [{"t": 100.0 + 0.1 * i, "event": "step", "step": i, "loss": 3.0} for i in range(1, 11)]
    ev.append({"t": 101.02, "event": "failure", "wid": "n0w1", "kind": "exit"})
    ev.append({"t": 101.30, "event": "recovered", "gen": 1, "recover_s": 0.28})
    ev += [{"t": 101.5 + 0.1 * i, "event": "step", "step": 10 + i, "loss": 2.9} for i in range(1, 6)]
    return ev


def test_the_dip_lies_over_the_gap_and_nowhere_else():
    xs, ys = step_rates([e for e in _events() if e["event"] == "step"])
    slow = [(x, y) for x, y in zip(xs, ys) if y < 5]
    assert len(slow) == 1  # one interval, from step 10 (t=101.0) to step 11 (t=101.6)
    x, y = slow[0]
    assert abs(x - 101.6) < 1e-9 and abs(y - 1 / 0.6) < 1e-9
    assert all(abs(y - 10) < 1e-6 for y in ys if y >= 5)


def test_a_recovery_spans_detection_to_the_next_step():
    ev = _events()
    ev.reverse()  # the log is not in time order across processes
    [(start, end, rec)] = recovery_spans(ev)
    assert (start, rec["gen"]) == (101.02, 1) and abs(end - 101.6) < 1e-9


def test_the_timeline_is_drawn(tmp_path):
    out = tmp_path / "t.png"
    plot_training(tmp_path, _events(), out)
    assert out.stat().st_size > 10_000 and out.read_bytes()[:4] == b"\x89PNG"
