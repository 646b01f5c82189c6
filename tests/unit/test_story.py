"""The console's wording of a job's events (observe/story.py), from event records alone."""

from phoenixft.observe.story import Story, done_line, duration, number, plural


def test_plurals_durations_and_numbers():
    assert plural(1, "failure") == "1 failure" and plural(2, "failure") == "2 failures"
    assert plural(0, "recovery") == "0 recoveries" and plural(1, "spare") == "1 spare"
    assert plural(3, "spare") == "3 spares" and plural(1, "completed step") == "1 completed step"
    assert duration(0.0176) == "18 ms" and duration(1.44) == "1.4 s"
    assert duration(125) == "2 min 05 s" and duration(float("nan")) == "?"
    assert number(2.633335590362549) == "2.633" and number(None) == "?"


def _gen(g, members, replaced=None, kind="run"):
    return {"event": "generation", "gen": g, "kind": kind, "members": members,
            "replaced": replaced or {}}


def test_generations_are_told_as_replace_shrink_and_grow():
    s = Story()
    assert s.tell(_gen(0, {"0": "a", "1": "b", "2": "c"})) == []
    [ln] = s.tell(_gen(1, {"0": "a", "1": "d", "2": "c"}, {"1": "b"}))
    assert ln.text == "phoenixft: generation 1: d takes rank 1 from b" and not ln.failure
    [ln] = s.tell(_gen(2, {"0": "a", "1": "c"}, {"1": "d"}))
    assert "no spare left: 2 ranks go on (was 3), taking over rank 1's microbatches" in ln.text
    [ln] = s.tell(_gen(3, {"0": "a", "1": "c", "2": "e"}))
    assert "e admitted: back to 3 ranks (was 2)" in ln.text
    # an HSDP replica group leaves whole: its live member is named with the dead one
    h = Story()
    h.tell(_gen(0, {"0": "a", "1": "b", "2": "c", "3": "d"}))
    [ln] = h.tell(_gen(1, {"0": "a", "1": "b"}, {"3": "d"}))
    assert ln.text == ("phoenixft: generation 1: no spare left: ranks 2, 3 leave with their "
                       "replica group; 2 ranks go on (was 4), taking over their microbatches")
    assert s.tell(_gen(3, {"0": "a", "1": "c", "2": "e"})) == []  # told once
    assert s.tell(_gen(4, {"0": "a", "1": "c", "2": "e"}, kind="done")) == []


def test_failures_hangs_and_damage_are_failure_lines_told_once():
    s = Story()
    e = {"event": "failure", "wid": "n0w1", "rank": 1, "kind": "hang", "gen": 0,
         "detail": "heartbeat silent (hung or lost)", "detect_s": 3.2}
    [ln] = s.tell(e)
    assert ln.failure
    assert ln.text == ("phoenixft: worker n0w1 (rank 1) failed: hung: its heartbeat went "
                       "silent; detected in 3.2 s by heartbeat deadline")
    assert s.tell(e) == []
    [ln] = s.tell({"event": "failure", "wid": "n0w3", "rank": None, "kind": "exit", "gen": 0,
                   "detail": "killed by SIGKILL", "detect_s": 0.01})
    assert ln.text.startswith("phoenixft: spare n0w3 failed: killed by SIGKILL")
    [ln] = s.tell({"event": "failure", "wid": "n0w0", "rank": 0, "kind": "damaged", "gen": 1,
                   "detail": "checksum mismatch", "detect_s": 0.5})
    assert "its snapshot is damaged in memory (checksum mismatch)" in ln.text
    assert s.tell({"event": "abort", "reason": "no spare is left"}) == []  # the last line says it


def test_a_recovery_names_its_source_and_time_once():
    s = Story()
    rec = {"gen": 2, "restore_step": 9, "recover_s": 0.063, "lost_steps": 1}
    [ln] = s.recovered(rec, "persistent")
    assert ln.text == ("phoenixft: generation 2 training again: restored step 9 from "
                       "persistent storage in 63 ms after detection, 1 completed step lost")
    assert s.recovered(rec, "persistent") == []


def test_the_done_line_says_where_to_look():
    line = done_line({"final_step": 1, "failures": [], "recoveries": [], "final_loss": 3.0,
                      "final_state_digest": "ab" * 32}, "runs/x")
    assert line == (f"phoenixft: done: 1 step, 0 failures, 0 recoveries; final loss 3, state "
                    f"digest {'ab' * 32}; details in runs/x/summary.json, timeline: "
                    "phoenixft plot runs/x")


def test_a_resume_and_a_passed_over_copy_are_told():
    s = Story()
    [ln] = s.tell({"event": "resumed", "step": 12, "source": "persistent", "world_size": 2,
                   "from_world_size": 4})
    assert ln.text == ("phoenixft: restored step 12 from persistent storage (2 ranks); "
                       "training continues at step 13")
    [ln] = s.tell({"event": "restore_source_failed", "rank": 1, "tier": "persistent",
                   "step": 8, "error": "r1/s8.delta: checksum mismatch"})
    assert ln.failure and ln.text == ("phoenixft: rank 1: a persistent copy of step 8 was "
                                      "passed over: r1/s8.delta: checksum mismatch")


def test_a_resharded_source_is_told_in_words():
    [ln] = Story().recovered({"gen": 1, "restore_step": 5, "recover_s": 0.2, "lost_steps": 0},
                             "resharded_4_to_3")
    assert "restored step 5 from every old rank's snapshot, resharded from 4 ranks to 3 in" in ln.text
    [ln] = Story().recovered({"gen": 1, "restore_step": 5, "recover_s": 0.2, "lost_steps": 0},
                             "resharded_2x2_to_4x1")  # a sharded model onto another mesh
    assert "resharded from a 2x2 mesh to a 4x1 one in" in ln.text


def test_a_grow_is_told_without_a_detection_time():
    [ln] = Story().recovered({"gen": 2, "restore_step": 4, "recover_s": None, "lost_steps": 0},
                             "resharded_2_to_4")
    assert "after detection" not in ln.text and "?" not in ln.text
    assert ln.text.startswith("phoenixft: generation 2 training again: restored step 4 from ")


def test_a_straggler_is_told_with_what_its_action_does():
    from phoenixft.observe.story import Story
    e = {"event": "straggler", "rank": 1, "wid": "n0w1", "ratio": 2.3, "window": 20,
         "step": 20, "gen": 0}
    told = {a: Story().tell({**e, "action": a})[0].text for a in ("report", "swap", "rebalance")}
    assert told["report"].endswith("--straggler report: reported only)")
    assert "a spare takes its rank at the next committed step" in told["swap"]
    assert "in proportion to its speed" in told["rebalance"]
    assert told["report"].startswith("phoenixft: rank 1 (n0w1) is a straggler: its compute "
                                     "per step is 2.3x the other ranks' median over the last "
                                     "20 steps")
    stalled = Story().tell({**e, "action": "report", "why": "stalled"})[0].text
    assert stalled.startswith("phoenixft: rank 1 (n0w1) is a straggler: its process stood "
                              "still (stopped or frozen) long enough for the steps to take "
                              "2.3x the other ranks' time over the last 20 steps"), stalled
