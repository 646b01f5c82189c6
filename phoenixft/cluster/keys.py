"""Every key of the job store, built by one function each, with the one role that writes it.

The store is the contract between agents, the leader and workers: a retyped literal
elsewhere would silently read a key nobody writes (a dropped recovery record, a fence
that never fires). So no other module spells a key; `tests/unit/test_keys.py` checks
that no store call in `phoenixft/` is given a string literal.

Writers, by role:
- leader (the agent holding the lease, node 0's by default): plans, fences, grow
  requests, its own state for a successor;
- agent (one per node): node registration, its node's heartbeat, exit and hang reports,
  spawns, goodbyes, the job id (node 0);
- worker (any training process): registration, finished marks, exit codes
  and errors (its runner), fault-injection claims and their timestamps;
- snapshot thread (in each worker): copy marks, acks, commits;
- rank 0 (the worker holding rank 0 of a generation): progress, losses, audits,
  results, recovery records;
- the last member of a node to join a generation: its node's restore sources.

Add-counters (`store.add`) may have many writers: that is what they are for.
"""

from __future__ import annotations

import enum


class ReportKind(str, enum.Enum):
    """What a failure report (`Keys.report`) says happened to a worker."""

    EXIT = "exit"  # agent: the process exited (its code or signal in the detail)
    ERROR = "error"  # agent: it exited after the user's script raised (the traceback)
    FATAL = "fatal"  # worker: recovery is impossible (no copy left of some state)
    HANG = "hang"  # agent: the worker's heartbeat stood still for the heartbeat timeout
    DAMAGED = "damaged"  # worker: a same-node peer's own snapshot is damaged in memory
    CORRUPT = "corrupt"  # worker: the fingerprint vote, its seal or a recomputation named it
    COLLECTIVE = "collective"  # worker: a collective failed (informational)
    ROLLBACK = "rollback"  # worker: the vote found tp copies that differ: same members, back

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__


class Keys:
    """Key names of the job store. Each method or constant names its writer."""

    # -- job and membership ------------------------------------------------------------
    JOB_ID = "job_id"  # agent of node 0, once: names the job's shared-memory directory
    REGISTERED = "registered"  # add-counter: worker registrations
    REPORTS = "reports"  # add-counter of failure reports (agents and workers)
    SPAWNS = "spawns"  # add-counter: workers respawned by agents (`spawn/{i}` each)
    AGENTS_DONE = "agents_done"  # add-counter: agents other than node 0 that are leaving

    @staticmethod
    def node(k: int) -> str:  # agent k: {"nproc", "spares", "pid"}
        return f"node/{k}"

    @staticmethod
    def worker(wid: str) -> str:  # the worker: {"pid", "node"}
        return f"worker/{wid}"

    @staticmethod
    def spawn(i: int) -> str:  # the agent that respawned worker i: {"wid", "node"}
        return f"spawn/{i}"

    @staticmethod
    def report(i: int) -> str:  # agents and workers: failure report i (see REPORTS)
        return f"report/{i}"

    @staticmethod
    def node_beat(k: int) -> str:  # agent k, every heartbeat period (add-counter; its
        # workers beat in the node's shared memory, `heartbeat.py`)
        return f"hb/node{k}"

    @staticmethod
    def failing(wid: str) -> str:  # the worker, just before an injected fault: wall time
        return f"failing/{wid}"

    @staticmethod
    def exit(wid: str) -> str:  # the worker's runner, as it ends: its exit code
        return f"exit/{wid}"

    @staticmethod
    def left(wid: str) -> str:  # the worker, exiting because its replica group left the job
        return f"left/{wid}"

    @staticmethod
    def finished(wid: str) -> str:  # the worker, once its Session.steps() completed
        return f"finished/{wid}"

    @staticmethod
    def error(wid: str) -> str:  # the worker's runner: an uncaught exception's traceback
        return f"error/{wid}"

    @staticmethod
    def inject(spec: str) -> str:  # workers: add-counter that lets a fault fire once per job
        return f"inject/{spec}"

    # -- leadership ----------------------------------------------------------------------
    LEADER = "leader"  # the agent that leads (compare_set): {"node", "term", "pid"}
    LEADER_STATE = "leader_state"  # the leader: what a successor needs (JSON, each change)

    @staticmethod
    def leader_beat(term: int) -> str:  # the leader of `term`: add-counter, every tick
        return f"leader_beat/{term}"

    # -- generations -------------------------------------------------------------------
    @staticmethod
    def plan(g: int) -> str:  # the leader: generation g's plan, written once
        return f"gen/{g}/plan"

    @staticmethod
    def plan_change(g: int) -> str:  # the leader, with gen/{g}/plan (one multi_set): plan
        # g as a change to plan g-1 (`Plan.change_from`; what a member of g-1 reads)
        return f"gen/{g}/change"

    @staticmethod
    def group(g: int, name: str) -> str:
        """Prefix of generation g's process group `name` ("train", "replicate"); the
        members' c10d rendezvous writes under it. Never reused across generations."""
        return f"gen/{g}/{name}/"

    @staticmethod
    def keep_vote(g: int, name: str, place: int) -> str:  # the member at `place` of
        # generation g's mesh group `name`: its ledger of the group it would keep, or
        # "build" (train/kept_groups.py)
        return f"gen/{g}/keep/{name}/{place}"

    @staticmethod
    def fence(wid: str) -> str:  # the leader: this worker must be killed by its agent
        return f"fence/{wid}"

    @staticmethod
    def fences(node: int) -> str:  # the leader, after each fence of node's workers: count
        return f"fences/{node}"

    @staticmethod
    def grow(g: int) -> str:  # the leader: generation g stops at a committed step (to admit
        # waiting spares, or to swap a straggler)
        return f"grow/{g}"

    @staticmethod
    def straggler(g: int) -> str:  # rank 0 of generation g: swap this straggler (JSON)
        return f"straggler/{g}"

    @staticmethod
    def grow_ready(g: int) -> str:  # rank 0: generation g stopped at a committed step
        return f"grow_ready/{g}"

    @staticmethod
    def recovered(g: int) -> str:  # rank 0 of generation g: its recovery record (JSON)
        return f"recovered/{g}"

    @staticmethod
    def sources(g: int, node: int) -> str:  # the last member of g on `node` to join: where
        # each of the node's members took its state from, {rank: source} (JSON)
        return f"sources/{g}/{node}"

    # -- snapshots ---------------------------------------------------------------------
    COMMITTED = "committed"  # snapshot threads, rank 0 on adoption: newest committed step

    @staticmethod
    def copied(g: int, rank: int, step: int) -> str:
        """rank's snapshot thread: its slot for `step` is complete (same-node holders
        copy it from shared memory once this is set)."""
        return f"copied/{g}/{rank}/{step}"

    @staticmethod
    def ack(g: int, step: int) -> str:  # snapshot threads: local copies + replicas done
        return f"ack/{g}/{step}"

    @staticmethod
    def rollback(step: int) -> str:
        """add-counter, the rank that reports a fingerprint rollback to `step` with nobody
        named: a second one stops the job (`fingerprints.py`)."""
        return f"rollback/{step}"

    @staticmethod
    def commit(step: int) -> str:
        """The snapshot thread whose ack completed `step` (or rank 0 adopting it at a
        recovery): {"generation", "world_size", ...}. Set after COMMITTED is raised."""
        return f"commit/{step}"

    # -- persistence ---------------------------------------------------------------------
    PERSISTED = "persisted"  # rank 0's persister: newest step committed by a manifest
    # rank 0, with each step's progress: the newest step whose state a fingerprint vote
    # vouched for (`Fingerprinter.vouched`); a persister voted on writes no manifest past it
    VOUCHED = "vouched"
    PERSIST_ERRORS = "persist_errors"  # add-counter: persisters, after each persist_error
    RESUMED_FROM = "resumed_from"  # rank 0 of generation 0: the persisted step it resumed

    @staticmethod
    def persist_stride(generation: int) -> str:
        """Rank 0's persister: the generation's ranks persist the steps that are multiples
        of this (1 until set; a new generation starts afresh)."""
        return f"persist_stride/{generation}"

    @staticmethod
    def persisted(generation: int, step: int, rank: int) -> str:
        """A rank's persister: its durable record of `step` in `generation` (a key of an
        older generation, whose rank may have written another record of the same step
        since, never stands for this one's)."""
        return f"persisted/{generation}/{step}/{rank}"

    @staticmethod
    def persist_error(rank: int) -> str:  # rank's persister: its last storage error
        return f"persist_error/{rank}"

    # -- progress and results (rank 0) ---------------------------------------------------
    UNIT = "unit"  # every rank at setup: ranks per failure unit (an HSDP replica group)
    MIN_WORLD = "min_world"  # node 0's agent at start: --min-nproc (workers check it at setup)
    MB_COUNT = "mb_count"  # add-counter: microbatch forward+backward passes, all ranks
    PROGRESS = "progress"  # rank 0: last completed step

    @staticmethod
    def loss(step: int) -> str:  # rank 0: global mean loss of a step
        return f"loss/{step}"

    @staticmethod
    def audit(step: int) -> str:  # rank 0: microbatch ids that contributed to a step
        return f"audit/{step}"

    @staticmethod
    def result(name: str) -> str:  # rank 0 at the end: "digest", "final_step"
        return f"result/{name}"
