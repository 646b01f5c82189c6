"""Per-step snapshots off the critical path, peer replicas, and the global commit.

After optimizer step t the session calls `begin(t, snapshot)` and goes on with the next
forward/backward. A background thread copies the snapshot's tensors into this rank's slot
for t (shared memory, double-buffered: slot t % 2), checksums it, acknowledges it, ships
it to the rank's replica holders and receives the replicas it holds for others. The
session's optimizer step-pre-hook calls `wait_copied(committed=True)`: step t+1 neither
mutates state that is still being copied nor runs before snapshot t is committed (every
copy and replica acknowledged), so a failure at any point loses at most the step in
flight and one more. Copy, replication and the wait for the commit overlap step t+1's
forward/backward (the thread sees the commit in the store; the pre-hook only reads what
the thread saw) and cost nothing when they fit in it.

Guarantees:
- Slot s % 2 is only rewritten once the previous snapshot (s-1, or the last one taken
  before a gap of an even number of steps) is committed, so the newest committed
  snapshot is always intact on every rank and every replica holder. A gap of odd length
  would put s in the slot of the newest committed snapshot: `begin` refuses it. (A
  rejected replica is the exception: its slot holds nothing loadable.)
- Snapshot t is committed when every rank's local copy and every replica are
  acknowledged in the store (``ack/{g}/{t}`` reaches its target); the acker that
  completes it sets ``commit/{t}`` and raises ``committed`` (monotonic). A replica that
  arrives damaged from another node is acknowledged too, marked rejected (never loaded)
  and reported: the step commits with one copy fewer (`_rejected_copy`, which stops the
  job when it happens `REJECT_LIMIT` times in a row). So is a same-node copy that failed
  its check while the peer's own slot is whole; a damaged peer slot is not acknowledged,
  and its rank is reported to be replaced (`_copy_local_replica`).
- Errors in the thread are re-raised in the training thread at the next `wait_copied`;
  a newer generation stops the thread quietly (the session is recovering anyway).
- A snapshot begun but not copied when the generation changes (the thread was still busy,
  or not yet scheduled, when the failure came) is still copied into host memory, without
  replicas or commit, if the slot it goes to holds no snapshot newer than the last one
  committed: the restore can then take that step (every survivor stands there) instead of
  rolling everyone back one step. The training thread is inside its recovery meanwhile,
  so the state does not change under the copy.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from phoenixft.checkpoint.device_copy import DeviceCopier, ready_event
from phoenixft.checkpoint.integrity import IntegrityError
from phoenixft.checkpoint.record import Snapshot
from phoenixft.checkpoint.replicate import exchange_slots
from phoenixft.checkpoint.slots import HEADER_BYTES, Layout, SlotFile, SlotKind, slot_path
from phoenixft.cluster.keys import Keys
from phoenixft.cluster.node_tally import NodeShare
from phoenixft.cluster.store import StoreGone, wait_for
from phoenixft.comm.collectives import CommFailure, Interrupt

REJECT_LIMIT = 3  # damaged replicas in a row from one rank that stop the job (_rejected_copy)


def mark_committed(store: dist.Store, step: int, info: dict) -> None:
    """Commit `step`: its marker (who wrote it, at which world size) and the monotonic
    `committed` key in one request, so no reader ever sees one without the other (a
    writer SIGSTOPped or killed between two separate writes left `committed` pointing at
    a step without a marker). Steps commit in order (snapshot t+1 is only written once t
    is committed), so `committed` only moves forward; a step below it only gets its marker."""
    current = int(store.get(Keys.COMMITTED)) if store.check([Keys.COMMITTED]) else -1
    keys, values = [Keys.commit(step)], [json.dumps(info)]
    if step > current:
        keys.append(Keys.COMMITTED)
        values.append(str(step))
    store.multi_set(keys, values)


POISON = 1 << 40  # taken off an acknowledgement count so that it never reaches its target


def retract_commit(store: dist.Store, generation: int, step: int, to: int, target: int,
                   timeout_s: float) -> bool:
    """Take back the commit of snapshot `step` of `generation` (a vote found that its state
    may differ from what it must be, `fingerprints.py`): its acknowledgement count is
    poisoned first, so no acknowledgement still to come commits it (the others may have
    left the generation with theirs unsent: nothing here waits for them); if the count had
    already reached its `target`, its acker's marker is awaited (the acker's next request).
    Then `committed` goes back to `to`, whose marker stays, and `step`'s is deleted. The
    members restore `to` at the next join, and `step` commits again when it is taken
    anew. (A `step` committed in an earlier generation, the one this generation restored,
    has no count in `generation`: it is taken back all the same.) False when an acker's
    marker was awaited and did not come within `timeout_s` (an acker that died between its
    acknowledgement and its marker writes none; one still alive could commit `step` anew
    after this returns: the caller says so)."""
    settled = True
    if store.add(Keys.ack(generation, step), -POISON) + POISON >= target:
        settled = wait_for(store, [Keys.commit(step)], timeout_s)
    store.multi_set([Keys.COMMITTED], [str(to)])
    store.delete_key(Keys.commit(step))
    return settled


def acknowledge(store: dist.Store, generation: int, step: int, count: int, target: int,
                world_size: int, node: NodeShare | None = None) -> bool:
    """Acknowledge `count` copies of snapshot `step` of `generation`; the acknowledgement
    that brings the step's count to `target` (every copy of every rank) commits it. True
    when this one did. With `node`, the node's members' counts are gathered on the node
    first and the last of them acknowledges them all (one store request a node)."""
    if node is not None:
        counts = node.offer_ack(generation, step, count)
        if counts is None:
            return False
        count = sum(counts)
    if store.add(Keys.ack(generation, step), count) != target:
        return False
    mark_committed(store, step, {"t": time.time(), "generation": generation,
                                 "world_size": world_size})
    return True


NODE_POLL_S = 0.002  # a member waiting for its node's commit mark looks this often
NODE_STORE_LOOK_S = 0.5  # ... and at the store itself this often


class Snapshotter:
    """One rank's snapshot thread for one generation: copies each step's unique state
    into double-buffered slot files in the node's shared memory (slot s % 2 is only
    rewritten once snapshot s-1 is committed), sends or copies replicas to their holders,
    acknowledges, and commits the step when every copy of every rank is acknowledged.
    `begin(step, snapshot)` returns at once; the optimizer's pre-step hook waits
    (`wait_copied`) before the next update may change the tensors. Errors surface to the
    training thread at that wait, never silently."""

    def __init__(self, *, shm_dir: str | Path, rank: int, generation: int,
                 connect: Callable[[], dist.Store], rep_pg: dist.ProcessGroup | None,
                 holders: list[int], sources: list[int], world_size: int,
                 nodes: dict[int, int], interrupt: Interrupt, timeout_s: float,
                 on_commit: Callable[[int, float], None] | None = None,
                 fault: Callable[[int, str], None] | None = None,
                 on_degraded: Callable[[str], None] | None = None,
                 on_damaged_source: Callable[[int, str], None] | None = None,
                 after_copy: Callable[[int], None] | None = None,
                 on_copied: Callable[[int, dict], None] | None = None,
                 garble: Callable[[int], bool] | None = None,
                 rot: Callable[[int], bool] | None = None) -> None:
        self.shm_dir = Path(shm_dir)
        self.rank = rank
        self.generation = generation
        self._connect = connect
        self._rep_pg = rep_pg
        me = nodes.get(rank)
        # Peers on another node get the slot over the replication group; a holder on the
        # same node copies it out of this rank's shared-memory slot itself (one memcpy,
        # no sockets), once this rank says the slot is complete.
        self._remote_holders = [h for h in holders if nodes.get(h) != me]
        self._remote_sources = [s for s in sources if nodes.get(s) != me]
        self._local_sources = [s for s in sources if nodes.get(s) == me]
        self._announce = any(nodes.get(h) == me for h in holders)
        self._target = world_size * (1 + len(holders))
        self._world_size = world_size
        # this node's members acknowledge together (`cluster/node_tally.py`)
        self._node = NodeShare.of(shm_dir, nodes, rank)
        self._node.open_acks(generation)
        self._interrupt = interrupt
        self._timeout = timeout_s
        self._on_commit = on_commit
        self._fault = fault or (lambda step, phase: None)  # fault-injection points
        self._on_degraded = on_degraded or (lambda detail: None)
        self._after_copy = after_copy or (lambda step: None)  # e.g. the persister's offer
        # (step, tensors): the copy is done and the tensors still unchanged (the seal)
        self._on_copied = on_copied or (lambda step, tensors: None)
        # (src rank, why): a same-node peer's own slot is damaged; the peer is to be replaced
        self._on_damaged_source = on_damaged_source or (lambda src, detail: None)
        # fault injection: True when the replicas of this step (received from another node
        # or copied on this one) are to be damaged; when this rank's own copy is (`rot`)
        self._garble = garble or (lambda step: False)
        self._rot = rot or (lambda step: False)
        self._rejected: dict[int, int] = {}  # damaged arrivals in a row, by sending rank
        self._slots: dict[tuple[str, int, int], SlotFile] = {}
        self._device = DeviceCopier()  # only used for tensors on a CUDA device
        self._tasks: queue.Queue = queue.Queue()
        self._copied_step = -1
        self._committed_step = -1  # the newest of this thread's snapshots seen committed
        self._begun_step = -1
        self._last_taken: int | None = None  # the thread's previous snapshot (gaps allowed)
        # the step the job started from (0, or a checkpoint's with --init-from): no step
        # before it was ever snapshotted, so its own snapshot waits for no commit
        self.origin = 0
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._stopped = False
        # stall_s: what snapshots cost the training thread (waiting for a copy to finish)
        self.stats = {"snapshots": 0, "copy_s": 0.0, "replicate_s": 0.0, "thread_cpu_s": 0.0,
                      "stall_s": 0.0}
        self._thread = threading.Thread(target=self._run, name=f"phoenixft-snap-r{rank}",
                                        daemon=True)
        self._thread.start()

    # -- training thread ------------------------------------------------------------
    def begin(self, step: int, snap: Snapshot) -> None:
        self._raise_error()
        if self._begun_step >= 0 and (step - self._begun_step) % 2 == 0:
            raise ValueError(f"snapshot {step} after snapshot {self._begun_step}: both would use "
                             f"slot {step % 2}, overwriting the newest committed snapshot; skip "
                             f"an even number of steps between snapshots")
        self._begun_step = step
        self._tasks.put((step, snap, ready_event(snap.tensors)))

    def wait_copied(self, committed: bool = False) -> None:
        """Block until the last begun snapshot is in host memory and, if `committed`,
        committed (the pre-hook). Without the commit wait a replication slower than a step
        let the commit lag two steps behind, and a node lost then cost two steps (seen on
        a loaded 2-core machine). The thread waits for the commit in the store, so the
        training thread pays no store round trip here."""
        target = self._begun_step
        t0 = time.perf_counter()
        try:
            self._wait(target, committed)
            self._raise_error()
            if self._copied_step < target:
                raise CommFailure("snapshot copy abandoned: the generation changed")
            if committed and self._committed_step < target:
                raise CommFailure(f"snapshot {target} not committed: the generation changed")
        finally:
            self.stats["stall_s"] += time.perf_counter() - t0

    def copied(self) -> bool:
        """`wait_copied` without raising: whether the last begun snapshot is in host
        memory. For the seal's check before the step's all-reduce: a failure in this
        thread then (a replica's peer died) is the all-reduce's to find, or the pre-hook's
        to raise, and its error stays for `wait_copied`."""
        target = self._begun_step
        t0 = time.perf_counter()
        self._wait(target, committed=False)
        self.stats["stall_s"] += time.perf_counter() - t0
        return self._copied_step >= target

    def _wait(self, target: int, committed: bool) -> None:
        with self._cond:
            while ((self._committed_step if committed else self._copied_step) < target
                   and self._error is None and not self._stopped):
                if self._interrupt.is_set():
                    break
                self._cond.wait(0.5)

    def retract(self, store: dist.Store, step: int, to: int) -> bool:
        """`retract_commit` of this generation's snapshot `step`, back to `to`."""
        return retract_commit(store, self.generation, step, to, self._target, self._timeout)

    def own(self, step: int) -> Snapshot:
        """This rank's own snapshot `step` in its slot, verified (views of shared memory:
        copy them before the slot is rewritten); IntegrityError when the slot holds
        another step or is damaged."""
        return self._slot(SlotKind.SNAP, self.rank, step).snapshot(step)

    def stop(self, join_timeout_s: float = 10.0) -> None:
        self._stopped = True
        self._tasks.put(None)
        self._interrupt.notify()
        self._thread.join(join_timeout_s)
        if not self._thread.is_alive():  # (else it may still offer to the node's tally)
            self._node.close()

    def _raise_error(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    # -- background thread ----------------------------------------------------------
    def _slot(self, kind: SlotKind, rank: int, step: int) -> SlotFile:
        key = (kind, rank, step % 2)
        if key not in self._slots:
            self._slots[key] = SlotFile(slot_path(self.shm_dir, kind, rank, step))
        return self._slots[key]

    def _run(self) -> None:
        # One intra-op thread for this thread's copies (per thread: training keeps its own
        # count). With the training's count, each large copy_ forked an OpenMP team that
        # competed with the training's own for the same cores: 35% more CPU per copy.
        torch.set_num_threads(1)
        store = self._connect()
        local_only = False  # the generation is gone: keep begun snapshots, nothing more
        while True:
            task = self._tasks.get()
            if task is None:
                return
            try:
                if local_only or self._stopped or self._interrupt.is_set():
                    local_only = True
                    self._keep_local(*task)
                else:
                    self._snapshot(store, *task)
            except CommFailure as exc:
                if not (self._stopped or self._interrupt.is_set()):
                    self._fail(CommFailure(f"snapshot replication failed: {exc}"))
                    return
                local_only = True  # (the rest of the queue until stop's None)
                with self._cond:  # a pre-hook waiting for this commit gives up now, not
                    self._cond.notify_all()  # at its next 0.5 s wake
            except BaseException as exc:  # noqa: BLE001 - surfaced to the training thread
                if local_only or self._stopped:  # nobody waits for this thread any more
                    self._on_degraded(f"snapshot {task[0]} not kept in host memory after the "
                                      f"generation changed: {type(exc).__name__}: {exc}")
                self._fail(exc)
                return

    def _fail(self, exc: BaseException) -> None:
        with self._cond:
            self._error = exc
            self._cond.notify_all()

    def wait_committed(self, step: int, store: dist.Store) -> None:
        """Training thread: block until snapshot `step` is committed (deadline, abandoned
        on a newer generation)."""
        self._wait_committed(store, step)

    def _wait_committed(self, store: dist.Store, step: int) -> None:
        if step >= 0:
            self._wait_key(store, Keys.commit(step))

    def _wait_key(self, store: dist.Store, key: str) -> None:
        """Wait for a store key, giving up on a newer generation, a stop or the deadline."""
        deadline = time.monotonic() + self._timeout
        while not self._stopped:
            if self._interrupt.is_set():
                raise CommFailure("generation changed")
            try:
                if wait_for(store, [key], 0.05):
                    return
            except StoreGone as exc:
                raise CommFailure(str(exc)) from None
            if time.monotonic() > deadline:
                raise CommFailure(f"{key} not set within {self._timeout}s")
        raise CommFailure("stopped")

    def _snapshot(self, store: dist.Store, step: int, snap: Snapshot,
                  ready: torch.cuda.Event | None) -> None:
        # The other slot must hold a committed snapshot before this one may be overwritten:
        # the thread's previous snapshot (it saw the commit), or for a new generation's
        # first snapshot the restored step, step - 1.
        if self._last_taken is None and step > self.origin:
            self._wait_committed(store, step - 1)
        self._last_taken = step
        cpu0 = time.thread_time()
        self._copy_and_replicate(store, step, snap, ready)
        self.stats["thread_cpu_s"] += time.thread_time() - cpu0
        self.stats["snapshots"] += 1

    def _keep_local(self, step: int, snap: Snapshot, ready: torch.cuda.Event | None) -> None:
        """The generation changed before this begun snapshot was copied: copy it into its
        slot, no replicas, no ack, if that slot holds nothing newer than the last snapshot
        committed (the thread saw its previous snapshot committed)."""
        if self._last_taken is None or self._committed_step < self._last_taken:
            return  # the slot may hold the newest committed snapshot: leave it
        self._last_taken = step
        self._write_local(step, snap, ready)

    def _write_local(self, step: int, snap: Snapshot, ready: torch.cuda.Event | None,
                     then: Callable[[int], None] = lambda step: None) -> tuple[SlotFile, Layout]:
        """Copy the snapshot into this rank's slot for `step`, call `then(step)`, and say
        so (`then` first: the training thread's end-of-job flush waits for the copy, then
        for the persister to have been offered the last step)."""
        tensors = snap.tensors
        layout = Layout.of(tensors)
        slot = self._slot(SlotKind.SNAP, self.rank, step)
        slot.ensure(HEADER_BYTES + layout.data_nbytes)
        slot.begin_write(step)
        digest = self._copy(slot, layout, tensors, ready, halfway=lambda: self._fault(step, "snapshot"))
        slot.finish_write(step, layout, snap.header.with_(generation=self.generation), digest)
        self._on_copied(step, tensors)
        then(step)
        with self._cond:
            self._copied_step = step
            self._cond.notify_all()
        return slot, layout

    def _copy_and_replicate(self, store: dist.Store, step: int, snap: Snapshot,
                            ready: torch.cuda.Event | None = None) -> None:
        t0 = time.perf_counter()
        slot, layout = self._write_local(step, snap, ready, then=self._after_copy)
        t1 = time.perf_counter()
        if self._rot(step):  # injected: its own copy damaged before any holder reads it
            slot.np[HEADER_BYTES + 7] ^= 0xFF
        if self._announce:
            store.set(Keys.copied(self.generation, self.rank, step), "1")
        acks = 1  # this rank's own copy; sent with the replicas it verified, in one request
        self._fault(step, "replicate")
        remote = self._rep_pg is not None and bool(self._remote_holders or self._remote_sources)
        # injected: the replicas of this step arriving or copied here damaged (one claim)
        garble = bool((remote and self._remote_sources) or self._local_sources) and \
            self._garble(step)
        if remote:
            recv = {src: self._slot(SlotKind.REP, src, step) for src in self._remote_sources}
            exchange_slots(self._rep_pg, send=slot,
                           send_nbytes=HEADER_BYTES + layout.data_nbytes,
                           dsts=self._remote_holders, recv=recv, interrupt=self._interrupt,
                           timeout_s=self._timeout)
            for src, rslot in recv.items():
                if garble:
                    rslot.np[HEADER_BYTES + 7] ^= 0xFF
                acks += self._check_replica(src, rslot, step)
        for src in self._local_sources:
            self._wait_key(store, Keys.copied(self.generation, src, step))
            acks += self._copy_local_replica(src, step, garble)
        committed_it = self._ack(store, step, acks)
        self._fault(step, "commit")
        self.stats["copy_s"] += t1 - t0
        self.stats["replicate_s"] += time.perf_counter() - t1
        if self._node.members > 1:
            self._node_committed(store, step, committed_it)
        elif not committed_it:
            self._wait_committed(store, step)
        with self._cond:
            self._committed_step = step
            self._cond.notify_all()

    def _node_committed(self, store: dist.Store, step: int, committed_it: bool) -> None:
        """A node of several members waits for a step's commit on the store once: the
        member whose offer completed the node's acknowledgement (it sent the node's add)
        waits there, unless its add committed the step, and marks the commit in the
        node's shared memory; the others wait for that mark."""
        name = f"commit-{self.generation}"
        if self._node.completed == f"ack-{self.generation}-{step}":
            if not committed_it:
                self._wait_committed(store, step)
            self._node.mark(name, step)
            return
        deadline = time.monotonic() + self._timeout
        look = time.monotonic() + NODE_STORE_LOOK_S
        while not self._node.marked(name, step):
            if self._stopped:
                raise CommFailure("stopped")
            if self._interrupt.is_set():
                raise CommFailure("generation changed")
            now = time.monotonic()
            if now > look:  # (a commit rank 0 adopted, or a marker that died: the store)
                look = now + NODE_STORE_LOOK_S
                if store.check([Keys.commit(step)]):
                    return
            if now > deadline:
                raise CommFailure(f"{Keys.commit(step)} not set within {self._timeout}s")
            time.sleep(NODE_POLL_S)

    def _copy(self, slot: SlotFile, layout: Layout, tensors: dict,
              ready: torch.cuda.Event | None, halfway: Callable[[], None]) -> str | None:
        """Copy the tensors into the slot; returns the data's checksum when it was computed
        on the way (host tensors), None when the slot must be hashed after the copy."""
        if ready is None:
            return slot.write_data(layout, tensors, halfway)
        self._device.pin(slot)  # tensors on a CUDA device (device_copy.py)
        for i, e in enumerate(layout.entries):
            if i == len(layout.entries) // 2:
                halfway()
            self._device.copy(slot.view(e), tensors[e.name].detach().reshape(e.shape), ready)
        self._device.synchronize()
        return None

    def _check_replica(self, src: int, rslot: SlotFile, step: int) -> bool:
        """Verify a replica received from another node; one that arrived damaged is
        rejected (`_rejected_copy`). Returns whether to acknowledge."""
        try:
            rslot.verify(step)
            self._rejected.pop(src, None)
            return True
        except IntegrityError as exc:
            rslot.reject()
            return self._rejected_copy(src, step, "arrived damaged", exc, same_node=False)

    def _rejected_copy(self, src: int, step: int, how: str, exc: IntegrityError,
                       same_node: bool) -> bool:
        """A replica whose sender's own copy is whole but which itself failed its check (a
        bad link, bad memory; already marked rejected) is named in the event log and
        acknowledged all the same: the step commits without this replica (until the next
        commit, that rank's state lives only in its own slot, and in persistent storage if
        that step was persisted), and the restore passes over it. Not acknowledging it
        would stall the commit until the deadline and stop the job over a copy it can do
        without. But `REJECT_LIMIT` damaged copies in a row from one rank are no passing
        fault: the job would run on without the copy it was set up to keep (and the
        sender's own memory may be what is bad), so that stops the job, naming the link.
        Returns True (acknowledge) or raises."""
        n = self._rejected[src] = self._rejected.get(src, 0) + 1
        if n >= REJECT_LIMIT:
            fault = ("this node's memory is faulty; check the host (dmesg, ECC)" if same_node
                     else "the network path or the memory between their nodes is faulty; "
                          "check the hosts (dmesg, NIC error counters, ECC)")
            raise IntegrityError(
                f"rank {src}'s replicas {how} {n} times in a row on rank {self.rank} "
                f"(snapshot {step}: {exc}): {fault} before resuming (--persist, --resume)"
            ) from None
        self._on_degraded(f"the replica of rank {src}'s snapshot {step} {how} and is "
                          f"rejected; the step commits without it: {exc}")
        return True

    def _copy_local_replica(self, src: int, step: int, garble: bool = False) -> bool:
        """Copy a same-node peer's slot out of shared memory, verifying the copy as it is
        written (`garble`: an injected damaged read). If the peer's file is gone (the
        node's shared memory was deleted by hand) the replica cannot exist: the step still
        commits, with one copy fewer, and says so. A copy that fails its check is told
        apart by checking the peer's slot itself: if that is whole, the copy went wrong
        and is rejected like a replica damaged in transit (`_rejected_copy`: acknowledged,
        the step commits without it); if the peer's own snapshot is damaged (its data or
        its header), no intact copy of that step exists on this node: it is not
        acknowledged, so the step cannot commit, and the peer is reported
        (`on_damaged_source`) so that the leader replaces it like a dead rank and the
        recovery restores the newest committed step, intact in the other slot (a peer that
        damaged its own slots and died, the `corrupt` fault, is replaced anyway). Returns
        whether to acknowledge."""
        try:
            source = self._peer_slot(src, step)
            if not source.is_mapped():
                raise FileNotFoundError(f"{source.path}: missing or empty")
        except OSError as exc:  # (also: deleted while we opened it)
            self._on_degraded(f"no replica of rank {src}'s snapshot {step}: {exc}")
            return True
        try:
            image = source.np[:source.used_nbytes()]
            if garble:
                image = image.copy()
                image[HEADER_BYTES + 7] ^= 0xFF
            self._slot(SlotKind.REP, src, step).put_image(image, step)
            self._rejected.pop(src, None)
            return True
        except IntegrityError as exc:
            try:
                source.verify(step)
            except IntegrityError as bad:
                why = (f"rank {src}'s own snapshot {step} is damaged in shared memory, so no "
                       f"intact copy of it exists on this node: not acknowledged, the step "
                       f"does not commit: {bad}")
                self._on_degraded(why)
                self._on_damaged_source(src, why)
                return False
            return self._rejected_copy(src, step, "was damaged in the copy", exc,
                                       same_node=True)

    def _peer_slot(self, src: int, step: int) -> SlotFile:
        """A same-node peer's slot, kept mapped across steps: mapping 5 MB afresh each step
        cost more CPU (page faults) than copying it (measured 4.8 ms of the snapshot
        thread's 9 ms per step with 2 workers on 2 cores)."""
        key = ("peer", src, step % 2)
        f = self._slots.get(key)
        if f is None or not f.is_current():
            f = self._slots[key] = SlotFile(slot_path(self.shm_dir, SlotKind.SNAP, src, step))
        return f

    def _ack(self, store: dist.Store, step: int, count: int) -> bool:
        """Acknowledge `count` copies of `step`; True when these completed its commit."""
        if acknowledge(store, self.generation, step, count, self._target, self._world_size,
                       self._node):
            if self._on_commit is not None:
                self._on_commit(step, time.time())
            return True
        return False
