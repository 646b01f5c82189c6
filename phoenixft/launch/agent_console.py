"""What a node's agent tells people, and the watchers behind it: progress lines, the
account of failures and recoveries (`observe/story.py`, from the leader's events), storage
errors of the persisters, and a run directory that cannot be written. The agent
(`agent.py`) calls these once a tick; they read the store and the event log and print,
never decide anything.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from phoenixft.cluster import store as kv
from phoenixft.cluster.keys import Keys
from phoenixft.cluster.membership import PlanKind
from phoenixft.cluster.report import restore_source
from phoenixft.launch.config import AgentConfig
from phoenixft.observe.events import EventFollower
from phoenixft.observe.story import Line, Story, plural


class AgentConsole:
    """One agent's console (stdout for progress and the account of recoveries, unless
    --quiet; stderr for failures and errors, always)."""

    def __init__(self, cfg: AgentConfig, run_dir: Path) -> None:
        self.cfg, self.run_dir = cfg, run_dir
        self.persisted_step = -1  # newest step committed to persistent storage, as last seen
        self._persist_t = 0.0
        self._persist_errors: dict[int, int] = {}
        self._persist_errors_seen = 0  # `Keys.PERSIST_ERRORS` when last read
        self.story = Story()  # the console's account of the job (the leader's agent tells it)
        self._follower: EventFollower | None = None
        self._told_gen = 0  # newest generation whose recovery the console has told
        self._progress = (0, time.monotonic())  # (step, when) of the last progress line
        self._cadence = cfg.cadence  # (steps, seconds) between progress lines, parsed once
        self._run_dir_error: str | None = None  # told on the console while writes fail

    def watch_persistence(self, store, leader, final: bool = False) -> None:
        """Twice a second, and once more at the end (`final`): remember the newest durable
        step (for the message if the store goes away) and, on the leader, show storage
        errors on the console once each (a job shorter than the interval still shows them)."""
        if not self.cfg.persistence.url or (not final and time.monotonic() - self._persist_t < 0.5):
            return
        self._persist_t = time.monotonic()
        self.persisted_step = kv.get_int(store, Keys.PERSISTED, -1)
        if leader is None or leader.plan is None:
            return
        errors = store.add(Keys.PERSIST_ERRORS, 0)  # the ranks are read only when it moved
        if errors == self._persist_errors_seen and not final:
            return
        self._persist_errors_seen = errors
        for r in range(leader.plan.world_size):
            if store.check([Keys.persist_error(r)]):
                err = kv.get_json(store, Keys.persist_error(r))
                if err["errors"] > self._persist_errors.get(r, 0):
                    if r not in self._persist_errors or err["errors"] % 20 == 0:
                        self.say(f"phoenixft: persisting to {self.cfg.persistence.url} fails on rank {r} "
                                  f"({err['error']}); training goes on, newest durable step "
                                  f"{self.persisted_step}", err=True)
                    self._persist_errors[r] = err["errors"]

    def watch_run_dir(self, events, leader) -> None:
        """A run directory that cannot be written (a full or read-only disk) costs its
        records, not the training: say so once when writes start failing and once when
        they work again, with what was lost."""
        status_err = leader.status_failing if leader is not None else None
        err = status_err or events.failing
        if err is not None and self._run_dir_error is None:
            self._run_dir_error = err.strerror or str(err)
            self.say(f"phoenixft: cannot write the run directory {self.run_dir} "
                      f"({self._run_dir_error}); training goes on, but events.jsonl and "
                      "status.json fall behind until there is room", err=True)
        elif self._run_dir_error is not None and status_err is None and leader is not None:
            lost = events.lost  # status.json is written again: is the log too?
            events.emit("run_dir_writable", lost_records=lost)
            if events.failing is None:
                self._run_dir_error = None
                self.say(f"phoenixft: the run directory {self.run_dir} is writable again "
                          f"({plural(lost, 'event record')} of this agent lost meanwhile)",
                          err=True)

    def echo_progress(self, store, leader) -> None:
        """A progress line at each multiple of `--log-every N` steps (each one, even when
        several passed between two ticks), or for the newest step every N seconds."""
        if not self.cfg.echo:
            return
        step = kv.get_int(store, Keys.PROGRESS, 0)
        last, t_last = self._progress
        if last == 0 and step > 0:  # a resumed job has no loss before its first step:
            # waiting for step 10's of a job resumed at 14 printed no progress line at all
            last = kv.get_int(store, Keys.RESUMED_FROM, 0)
        every_steps, every_s = self._cadence
        now = time.monotonic()
        if every_steps is not None:
            due = list(range((last // every_steps + 1) * every_steps, step + 1, every_steps))
        else:
            due = [step] if step > last and now - t_last >= every_s else []
        for s in due:
            if not store.check([Keys.loss(s)]):
                return  # its loss is not written yet: next tick
            rate = (s - last) / (now - t_last) if now > t_last and s > last else 0.0
            gen = leader.plan.generation if leader.plan else 0
            self.say(f"step {s:6d}  loss {float(store.get(Keys.loss(s))):.4f}  "
                      f"{rate:5.2f} steps/s  gen {gen}")
            last, t_last = s, now
            self._progress = (s, now)

    def tell(self, store, events, leader) -> None:
        """The console's account of what happened: the leader's events (failures, new
        generations, stops) as they are logged, and each generation's recovery once rank 0
        has recorded it in the store (it may run on another node, whose log is not ours)."""
        if events.path is None:
            return
        if self._follower is None:
            self._follower = EventFollower(events.path)
        for e in self._follower.poll():
            self.show(self.story.tell(e))
        plan = leader.plan
        if plan is None or plan.kind is not PlanKind.RUN or plan.generation <= self._told_gen:
            return
        g = plan.generation
        if store.check([Keys.recovered(g)]):
            src = restore_source(store, plan, min(plan.replaced, default=0))
            self.show(self.story.recovered(kv.get_json(store, Keys.recovered(g)), src))
            self._told_gen = g

    def show(self, lines: list[Line]) -> None:
        for ln in lines:
            self.say(ln.text, err=ln.failure)

    def say(self, msg: str, err: bool = False, always: bool = False) -> None:
        """stdout for progress and the account of recoveries (not with --quiet); stderr,
        always, for failures and errors; `always` for the summary line."""
        if self.cfg.echo or err or always:
            print(msg, file=sys.stderr if err else sys.stdout, flush=True)
