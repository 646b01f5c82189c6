"""What `phoenixft run` prints while a job runs: one line per thing that happened, told for
a person (who died, how it was seen, who took its rank, where its state came from and how
long that took), and progress lines at a regular cadence.

The agent that leads the job feeds it the job's events (`failure`, `generation`, ...; a
stop is told by the agent's last line) and the recovery records rank 0 writes to the
store; this module only words them, so the wording is unit-tested without a job. Each
event is told once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# where a restored state came from (restore sources), in words
_SOURCES = {"local_snapshot": "a snapshot in the node's shared memory",
            "local_replica": "a replica in the node's shared memory",
            "replica": "a peer's replica", "peer": "a peer's replica",
            "persistent": "persistent storage", "none": "nowhere (a fresh start)"}

_IRREGULAR = {"failure": "failures", "recovery": "recoveries", "spare": "spares",
              "worker": "workers", "step": "steps", "rank": "ranks",
              "completed step": "completed steps", "event record": "event records"}


def source_words(name: str | None) -> str:
    """A restore source's name (`Keys.sources`) in words."""
    if name and name.startswith("resharded_"):
        old, _, new = name.removeprefix("resharded_").partition("_to_")
        if "x" in old:  # a sharded model's mesh shapes (dp_shard x tp)
            return f"every old rank's snapshot, resharded from a {old} mesh to a {new} one"
        return f"every old rank's snapshot, resharded from {old} ranks to {new}"
    return _SOURCES.get(name or "", name or "?")


def plural(n: int, word: str) -> str:
    """`1 failure`, `2 failures`, `0 recoveries`."""
    return f"{n} {word if n == 1 else _IRREGULAR.get(word, word + 's')}"


def duration(s: float | None) -> str:
    """Seconds rounded for people: `18 ms`, `1.4 s`, `2 min 05 s`."""
    if s is None or not math.isfinite(s):
        return "?"
    if s < 1:
        return f"{s * 1000:.0f} ms"
    if s < 60:
        return f"{s:.1f} s"
    return f"{int(s // 60)} min {int(s % 60):02d} s"


def number(x: float | None) -> str:
    """A loss or similar for people: 4 significant digits."""
    return "?" if x is None else f"{x:.4g}"


def _cause(kind: str, detail: str) -> str:
    if kind == "hang":
        return "hung: its heartbeat went silent"
    if kind == "corrupt":
        return f"silent data corruption: {detail}"
    if kind == "damaged":
        return f"its snapshot is damaged in memory ({detail})"
    if kind == "quarantined_node":
        return f"fenced with its node: {detail}"
    return detail.splitlines()[0] if detail else kind


_SEEN_BY = {"exit": "process exit", "error": "process exit", "hang": "heartbeat deadline",
            "damaged": "its replica holder's check",
            "corrupt": "fingerprints (the ranks' vote, or its own seal) or recomputation",
            "quarantined_node": "its node's quarantine"}


@dataclass(frozen=True, slots=True)
class Line:
    """One console line; `failure` lines stay under `--quiet`."""
    text: str
    failure: bool = False


class Story:
    """Turns events into console lines. Keeps the previous generation's members, so a new
    generation can be told as who took which rank, or as a shrink or a grow."""

    def __init__(self) -> None:
        self._members: dict[int, str] = {}
        self._told: set[tuple] = set()

    def _once(self, key: tuple) -> bool:
        if key in self._told:
            return False
        self._told.add(key)
        return True

    def tell(self, e: dict) -> list[Line]:
        ev = e.get("event")
        if ev == "failure" and self._once(("failure", e.get("wid"), e.get("gen"))):
            who = (f"worker {e['wid']} (rank {e['rank']})" if e.get("rank") is not None
                   else f"spare {e['wid']}")
            return [Line(f"phoenixft: {who} failed: {_cause(e.get('kind', ''), e.get('detail', ''))}"
                         f"; detected in {duration(e.get('detect_s'))} by "
                         f"{_SEEN_BY.get(e.get('kind'), e.get('kind', '?'))}", failure=True)]
        if ev == "generation":
            return self._generation(e)
        if ev == "node_quarantined" and self._once(("node_quarantined", e.get("node"))):
            return [Line(f"phoenixft: node {e.get('node')} quarantined: "
                         f"{len(e.get('named', []))} of its workers were named "
                         f"({', '.join(e.get('named', []))}); its workers "
                         f"{', '.join(e.get('fenced', [])) or '(none left)'} are fenced and "
                         "its spares never used", failure=True)]
        if ev == "straggler" and self._once(("straggler", e.get("wid"), e.get("gen"))):
            then = {"swap": "a spare takes its rank at the next committed step, if there is one",
                    "rebalance": "from the next step it gets a share of the microbatches in "
                                 "proportion to its speed"}.get(e.get("action"), "reported only")
            place = f", {e['where']}" if e.get("where") else ""
            others = "the same stage's ranks'" if e.get("where") else "the other ranks'"
            what = (f"its process stood still (stopped or frozen) long enough for the steps "
                    f"to take {e.get('ratio')}x {others} time" if e.get("why") == "stalled" else
                    f"its compute per step is {e.get('ratio')}x {others} median")
            return [Line(f"phoenixft: rank {e.get('rank')} ({e.get('wid')}{place}) is a "
                         f"straggler: {what} over the last {e.get('window')} steps (step "
                         f"{e.get('step')}; --straggler {e.get('action')}: {then})",
                         failure=True)]
        if ev == "straggler_swapped":
            return [Line(f"phoenixft: straggler {e.get('wid')} (rank {e.get('rank')}, "
                         f"{e.get('ratio')}x) swapped for spare {e.get('spare')} at the next "
                         "committed step; it is fenced and not re-admitted", failure=True)]
        if ev == "straggler_kept":
            return [Line(f"phoenixft: straggler {e.get('wid')} (rank {e.get('rank')}) kept: "
                         f"{e.get('reason')}", failure=True)]
        if ev == "snapshot_degraded":
            return [Line(f"phoenixft: rank {e.get('rank')}: a snapshot copy was rejected "
                         f"({e.get('detail')}); the step commits without it", failure=True)]
        if ev == "restore_source_failed":
            step = f" of step {e['step']}" if e.get("step") is not None else ""
            return [Line(f"phoenixft: rank {e.get('rank')}: a {e.get('tier')} copy{step} was "
                         f"passed over: {e.get('error', e.get('detail', ''))}", failure=True)]
        if ev == "resumed" and self._once(("resumed",)):
            src = source_words(e.get("source"))
            return [Line(f"phoenixft: restored step {e.get('step')} from {src} "
                         f"({plural(e.get('world_size') or 0, 'rank')}); training continues "
                         f"at step {(e.get('step') or 0) + 1}")]
        if ev == "problem":
            return [Line(f"phoenixft: problem: {e.get('detail')}", failure=True)]
        if ev == "lead_taken":
            return [Line(f"phoenixft: node {e.get('node')} leads the job now (term {e.get('term')})")]
        return []

    def _generation(self, e: dict) -> list[Line]:
        members = {int(r): w for r, w in (e.get("members") or {}).items()}
        before, self._members = self._members, members
        g = e.get("gen")
        if e.get("kind") != "run" or not before or not self._once(("gen", g)):
            return []
        replaced = {int(r): w for r, w in (e.get("replaced") or {}).items()}
        n0, n = len(before), len(members)
        gone = sorted(r for r, w in before.items() if w not in members.values())
        if n < n0 and set(gone) != set(replaced):  # whole replica groups left (HSDP)
            what = (f"no spare left: ranks {', '.join(map(str, gone))} leave with their "
                    f"replica group; {plural(n, 'rank')} go on (was {n0}), taking over "
                    "their microbatches")
        elif n < n0:
            what = (f"no spare left: {plural(n, 'rank')} go on (was {n0}), taking over "
                    f"{', '.join(f'rank {r}' for r in sorted(replaced))}'s microbatches")
        elif n > n0:
            new = [w for r, w in sorted(members.items()) if r >= n0]
            what = f"{', '.join(new)} admitted: back to {plural(n, 'rank')} (was {n0})"
        elif replaced:
            what = "; ".join(f"{members[r]} takes rank {r} from {w}"
                             for r, w in sorted(replaced.items()))
        else:
            what = f"the same {plural(n, 'rank')} regroup"
        return [Line(f"phoenixft: generation {g}: {what}")]

    def recovered(self, rec: dict, source: str | None) -> list[Line]:
        """Rank 0's record of generation `rec['gen']` finishing its recovery."""
        if not self._once(("recovered", rec.get("gen"))):
            return []
        step = rec.get("restore_step")
        src = source_words(source)
        where = (f"restored step {step} from {src}" if step is not None and step >= 0
                 else "no step to restore (none committed yet)")
        lost = rec.get("lost_steps", 0)
        took = (f" in {duration(rec.get('recover_s'))} after detection"
                if rec.get("recover_s") is not None else "")  # (a grow: nothing failed)
        return [Line(f"phoenixft: generation {rec.get('gen')} training again: {where}{took}, "
                     f"{plural(lost, 'completed step')} lost")]


def done_line(summary: dict, run_dir: str) -> str:
    """The summary line at a successful end, ending with where to look."""
    n_fail, n_rec = len(summary.get("failures", [])), len(summary.get("recoveries", []))
    digest = summary.get("final_state_digest") or "?"
    return (f"phoenixft: done: {plural(summary.get('final_step', 0), 'step')}, "
            f"{plural(n_fail, 'failure')}, {plural(n_rec, 'recovery')}; final loss "
            f"{number(summary.get('final_loss'))}, state digest {digest}; details in "
            f"{run_dir}/summary.json, timeline: phoenixft plot {run_dir}")
