"""The session's side of consensus (`consensus.py` has the digests, the tally and the
seal): what a rank checks before the step's all-reduce, and the vote after it.

Carried (`--fingerprint-vote carried`, the default): the vote has no synchronisation of
its own. Before step T+1's all-reduce each rank writes into its own slots of that
all-reduce (`ReduceLayout.fingerprints`) the digest of step T's reduced gradients (taken
right after T's all-reduce), the digests of its state now (the parameters T's update
left, which T+1's passes used; the optimizer shards every replica holds) and its seal's
result; after the all-reduce every rank holds every rank's and votes alike. What differs
came from step T (its update, or memory since), so snapshot T may hold it: the job rolls
back to T-1, the last state a vote vouched for, whose snapshots every rank still holds
(`_roll_back`: the last commit taken back, a rank outside a strict majority replaced,
otherwise the same members go on). A seal that broke names its rank as before (snapshot
T was taken before the change). The cost: the digests and the seal (about 0.25 ms of the
training thread's CPU a voted step here, `fp_cpu_s`, of a 65 ms step), a few floats a
rank in the all-reduce, and one step more to redo when something is found. A rank
without the step before's gradient digest (a spare that joined since) is left out of
that vote. After the last step one tiny all-reduce votes on what the last step left
(`final`). With two ranks a difference rolls back; the same rollback found twice stops
the job (a persistent fault nobody can attribute).

Separate (`--fingerprint-vote separate`, the scheme below): after the step's all-reduce,
before the update, each rank checks its own seal (its
unique state against the hashes the snapshot thread took once the last snapshot was
copied: the optimizer's pre-hook would wait for that copy here anyway). Every
`--fingerprint-every` steps the ranks then vote on digests of the reduced gradients and
of the parameters, with each rank's seal result in the same tiny all-reduce; with no
strict majority the step's collectives are replayed. Ranks named are reported to the
leader (CORRUPT: it fences and replaces them, and quarantines the worker) and the step is
abandoned before its update, like one whose peer died: the others keep their
microbatches. On a step without a vote a rank whose seal broke reports itself and stops
before its update; the others learn it when the leader replaces it (their all-gather is
interrupted) and redo the step from the last snapshot.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from phoenixft.checkpoint.integrity import IntegrityError
from phoenixft.cluster.keys import Keys, ReportKind
from phoenixft.config import Fingerprints
from phoenixft.observe.events import EventLog
from phoenixft.train import consensus
from phoenixft.train.rank_state import RankState
from phoenixft.train.step import Step, StepPhase

NONE = consensus.NONE
_NO_GRADS = torch.empty(0)  # (`fingerprinted` outside the all-reduce: no gradients yet)


def carried_slots(cfg: Fingerprints, layout) -> int:
    """Float slots a rank takes in the step's all-reduce for the carried vote (0: a layout
    without a vote): per digest of `fingerprinted`'s parts, and the seal's mask. Taken
    whatever `cfg` says (left zero when the vote is off, separate or skipped): a ring
    all-reduce's chunks follow the buffer's length, so a buffer of another length sums the
    gradients in another order, and a job would end on other bits with the vote off."""
    parts = layout.vote.fingerprinted(torch.empty(0))
    if parts is None:
        return 0
    return (len(parts) + 1) * consensus.chunks(layout.math.master_dtype)


def votes_on_state(cfg: Fingerprints, layout, world_size: int) -> bool:
    """A vote checks this job's state: fingerprints on, and some ranks hold copies of the
    same state (plain FSDP2 has only its seals)."""
    return bool(cfg.every) and any(len(c) > 1 for c in layout.vote.vote_classes(world_size))


def off_block(cfg: Fingerprints, index: int) -> bool:
    """Step `index` is in one of the consensus benchmark's off blocks (no seal, no vote)."""
    return bool(cfg.blocks) and (index - 1) // cfg.blocks % 2 == 1


def sealed(cfg: Fingerprints, step: int) -> bool:
    """Snapshot `step`'s unique state is hashed once copied (`consensus.Seal`): a seal
    check reads the hashes before step `step + 1`'s update. Not with fingerprints off, nor
    before one of the benchmark's off steps, so that their blocks pay nothing for it."""
    return bool(cfg.every) and not off_block(cfg, step + 1)


class Fingerprinter:
    def __init__(self, cfg: Fingerprints, member, events: EventLog) -> None:
        self.cfg = cfg
        self.member = member
        self.events = events
        self._filled: tuple | None = None  # what `fill` wrote into this step's all-reduce
        self._carry: tuple[int, int] | None = None  # (step, its reduced gradients' digest)
        self._slots: int | None = None  # (`slots`)
        # this step's costs on the critical path (0: not done this step): the seal check,
        # the digests, and the digests plus the vote's all-reduce (which includes waiting
        # for the slowest rank); the step event carries them
        self.seal_s = self.digest_s = self.vote_s = 0.0
        # and by this thread's CPU clock, all of it (waits excluded: on a busy machine the
        # steadier figure; `bench consensus` reports it beside the throughput)
        self.cpu_s = 0.0
        self._pending: tuple | None = None  # a vote left running through the update
        self._vouched = -1  # the newest step whose state a vote here found alike (`vouched`)
        self._votes: tuple[int, bool] | None = None  # (world size, `votes_on_state` in it)
        self._seen = -1  # the step `vouched` was last asked at

    def slots(self, state: RankState) -> int:
        """`carried_slots` of this session's layout (fixed once it joined: asked once)."""
        if self._slots is None:
            self._slots = carried_slots(self.cfg, state.layout)
        return self._slots

    @property
    def carries(self) -> bool:
        """The vote rides in the step's own all-reduce (`--fingerprint-vote carried`)."""
        return bool(self.cfg.every) and self.cfg.vote == "carried"

    def vouched(self, state: RankState) -> int:
        """The newest step whose state a vote vouched for: the state step t left is voted
        on at step t+1 (or after the last step), and a difference rolls t back, so a
        persisted manifest must not run ahead of this (`checkpoint/persist.py`,
        "Vouched"). With no vote to wait for, the step this rank is at."""
        world = self.member.world_size
        if self._votes is None or self._votes[0] != world:  # (asked every step: once a world)
            self._votes = (world, votes_on_state(self.cfg, state.layout, world))
        if state.step < self._seen:  # the job went back (a recovery restored an older
            # step, or a rollback): the steps it does again are vouched for again
            self._vouched = min(self._vouched, state.step - 1)
        self._seen = state.step
        return self._vouched if self._votes[1] else state.step

    def costs(self) -> dict[str, float]:
        return {"vote_s": round(self.vote_s, 6), "digest_s": round(self.digest_s, 6),
                "seal_s": round(self.seal_s, 6), "fp_cpu_s": round(self.cpu_s, 6)}

    def seal_mask(self, state: RankState) -> int:
        """With fingerprints and snapshots on: which of this rank's unique tensors (its
        optimizer shard) changed since its last snapshot was copied and sealed, as a bit
        mask over their sorted names (0: none, or no seal to check)."""
        member = self.member
        self.seal_s = 0.0
        if not self.cfg.every or member.snap is None or not member.snap.copied():
            return 0  # (a snapshot thread that failed: the step's collectives or the
            # optimizer's pre-hook raise it)
        t0 = time.perf_counter()
        unique = state.layout.state.unique_tensors()
        changed = member.seal.check(state.step, unique)
        if changed is None:
            return 0
        self.seal_s = time.perf_counter() - t0
        if not changed:
            return 0
        names = sorted(unique)  # (every rank lists the same names: `_act` decodes the mask)
        return sum(1 << min(names.index(n), 62) for n in set(changed))

    # -- carried in the step's all-reduce ------------------------------------------------
    def _off(self, index: int) -> bool:
        return off_block(self.cfg, index)

    def _due(self, index: int) -> bool:
        return bool(self.cfg.every) and not index % self.cfg.every and not self._off(index)

    def fill(self, st: Step, state: RankState, mine: torch.Tensor | None,
             force: bool = False) -> None:
        """Before step `st`'s all-reduce (carried vote; `mine`: this rank's slots in it, or
        None when the vote is not carried): the seal, and on a voted step (or `force`) the
        digests of the step before's reduced gradients and of the state now, with the
        seal's mask."""
        c0 = time.thread_time()
        try:
            self._fill(st, state, mine, force)
        finally:
            self.cpu_s = time.thread_time() - c0

    def _fill(self, st: Step, state: RankState, mine: torch.Tensor | None,
              force: bool) -> None:
        self.seal_s = self.digest_s = self.vote_s = 0.0
        self._filled = None
        if mine is None or not mine.numel() or not self.carries \
                or (self._off(st.index) and not force):
            return
        mask = self.seal_mask(state)
        if not (force or self._due(st.index)):
            self._filled = (None, mask)
            return
        t0 = time.perf_counter()
        parts = state.layout.vote.fingerprinted(_NO_GRADS)
        carried = self._carry[1] if self._carry and self._carry[0] == st.index - 1 else NONE
        digests = [carried, *(consensus.digest_all(ts) for ts in list(parts.values())[1:]), mask]
        consensus.encode_into(digests, mine)
        self.digest_s = time.perf_counter() - t0
        self._filled = (list(parts), mask)

    def _carried(self, st: Step, state: RankState, grads: torch.Tensor,
                 slots: torch.Tensor) -> None:
        """After step `st`'s all-reduce (`slots`: every rank's fingerprints): the vote on
        what `fill` wrote, then the digest of this step's reduced gradients for the next
        voted step's all-reduce."""
        filled, self._filled = self._filled, None
        member = self.member
        rank, world = member.rank, member.world_size
        if filled is not None:
            keys, mask = filled
            if keys is None:  # (no vote this step: a broken seal reports itself)
                if mask:
                    self._act(st, state, {rank: mask}, {}, voted=False)
            else:
                t0 = time.perf_counter()
                n = len(keys) + 1
                # (each rank's row: its digests, then its mask) the usual step: every rank
                # wrote the same digests and no seal broke, so there is nothing to decode
                # or judge; otherwise each class's ranks are compared
                if not consensus.alike(slots, world, consensus.chunks(slots.dtype)):
                    flat = consensus.decode(slots, world * n)  # (rank-major: each its n)
                    *first, masks = [[flat[r * n + i] for r in range(world)] for i in range(n)]
                    self._judge(st, state, keys, first, masks)
                self._vouched = max(self._vouched, st.index - 1)
                self.vote_s = time.perf_counter() - t0
        # (charged to this step: the benchmark's on / off blocks then each pay their own)
        if self.cfg.every and not (st.index + 1) % self.cfg.every and not self._off(st.index):
            t0 = time.perf_counter()
            parts = state.layout.vote.fingerprinted(grads)
            self._carry = (st.index, consensus.digest_all(next(iter(parts.values()))))
            self.digest_s += time.perf_counter() - t0

    def _judge(self, st: Step, state: RankState, keys: list[str], tally: list[list[int]],
               masks: list[int]) -> None:
        """The carried vote's verdict on step `st`'s tally (`tally[0]`: the step before's
        reduced gradients; the others: the state now): a difference rolls back
        (`_roll_back`), a broken seal alone names its rank (`_act`)."""
        world = self.member.world_size
        broken = {r: m for r, m in enumerate(masks) if m > 0}
        classes = [c for c in state.layout.vote.vote_classes(world) if len(c) > 1]
        split = None
        if not classes:  # (nobody holds a copy of another's state: the seals alone)
            if broken:
                self._act(st, state, broken, {}, voted=True)
            return
        try:
            found = consensus.outliers(tally, classes, keys, skip=NONE)
        except consensus.NoMajority as exc:
            found, split = {}, str(exc)
        if found or split is not None:
            named: dict[int, str] = {}
            for i, ranks in sorted(found.items()):  # (each rank by the first it differs in)
                for r in ranks:
                    named.setdefault(r, f"rank {r}'s {keys[i]} (step "
                                        f"{st.index - 1 if i == 0 else st.index}) differ from "
                                        "the majority's")
            self._roll_back(st, state, broken, named, split)
        if broken:
            self._act(st, state, broken, {}, voted=True)

    def final(self, state: RankState) -> None:
        """After the last step, the checks the next step would have run before its update
        (a step's vote and seal cover what the step before left: a flip on the last step
        escaped them and the job ended, saved and reported another state): the seal of
        this rank's unique state against its last snapshot, and the vote on what the ranks
        must hold alike, over a zero gradient every rank holds. Raises like `begin`: the
        session then recovers (the rank named is replaced, every rank restores the last
        committed snapshot) and checks again."""
        if not self.cfg.every:
            return
        lay = state.layout
        total = lay.math.grad_numel()
        zeros = torch.zeros(total, dtype=lay.math.master_dtype, device=lay.math.device)
        st = Step(state.step + 1, [], 0)
        k = self.slots(state)
        if k and self.carries:  # the carried vote: what the last step left, in one tiny all-reduce
            member = self.member
            slots = torch.zeros(member.world_size * k, dtype=lay.math.master_dtype,
                                device=lay.math.device)
            self.fill(st, state, slots.view(member.world_size, k)[member.rank], force=True)
            member.ops.allreduce(slots, f"fingerprint vote (after step {state.step})")
            self._carried(st, state, zeros, slots)
            return
        self.begin(st, state, zeros, total, every_step=True)
        self.settle()

    def begin(self, st: Step, state: RankState, grads: torch.Tensor, total: int,
              every_step: bool = False, slots: torch.Tensor | None = None) -> None:
        """Step `st`, all-reduced (`grads`: the reduced gradient region, at the start of a
        buffer of `total` elements), not yet updated: the seal, and when it is the vote's
        turn its digests and its all-reduce, left running through the optimizer step when
        that step can be undone (`settle`, from the update, awaits it); otherwise settled
        now. Raises `consensus.Outvoted` when a rank is named, `consensus.NoMajority` when
        nobody can be. With the vote carried (`slots`: every rank's fingerprints from the
        step's all-reduce) the vote is on what `fill` wrote (`_carried`)."""
        c0 = time.thread_time()
        try:
            self._begin(st, state, grads, total, every_step, slots)
        finally:
            self.cpu_s += time.thread_time() - c0

    def _begin(self, st: Step, state: RankState, grads: torch.Tensor, total: int,
               every_step: bool, slots: torch.Tensor | None) -> None:
        if slots is not None and slots.numel() and self.carries:
            self._carried(st, state, grads, slots)
            return
        self.vote_s = self.digest_s = 0.0
        self._pending = None
        member = self.member
        rank, world = member.rank, member.world_size
        if not every_step and self._off(st.index):
            return  # the consensus benchmark's off blocks: no seal, no vote
        mask = self.seal_mask(state)
        lay = state.layout
        due = self.cfg.every and (every_step or not st.index % self.cfg.every)
        parts = lay.vote.fingerprinted(grads) if due else None
        classes = [c for c in lay.vote.vote_classes(world) if len(c) > 1]
        if parts is None or not classes:
            if mask:
                self._act(st, state, {rank: mask}, {}, voted=False)
            return
        t0 = time.perf_counter()
        mine = [consensus.digest_all(ts) for ts in parts.values()]
        self.digest_s = time.perf_counter() - t0
        tally = consensus.Tally(member.ops, rank, world, [*mine, mask],
                                f"fingerprint vote (step {st.index})")
        self.vote_s = time.perf_counter() - t0
        self._pending = (st, state, list(parts), classes, tally, total)
        if member.snap is None or not lay.vote.can_undo():
            self.settle()

    def settle(self, gathered: Callable[[], None] | None = None) -> None:
        """The vote begun by `begin`, awaited: from the update (`gathered`: waits for the
        parameters' all-gather, issued after the optimizer step and before this), or at
        once (None). A rank named after an update makes every rank put back its own
        snapshot of the step before (its seal vouched for it) and gather the parameters
        again, so the step is abandoned as if no update had run."""
        if self._pending is None:
            return
        st, state, keys, classes, tally, total = self._pending
        self._pending = None
        t0 = time.perf_counter()
        *first, masks = tally.result()
        self.vote_s += time.perf_counter() - t0  # (the digests, and waiting for the vote)
        broken = {r: m for r, m in enumerate(masks) if m}
        rolls = state.layout.vote.rolls_back()
        split = None  # why no strict majority decides (a layout that rolls back)
        try:
            found, how = consensus.outliers(first, classes, keys), "differ from the majority's"
        except consensus.NoMajority as exc:
            if rolls:
                found, how, split = {}, "", str(exc)
            elif not state.layout.math.local_gradients:  # (nothing to replay the step from)
                raise consensus.NoMajority(
                    f"step {st.index}: the fingerprints of the ranks that must agree differ "
                    f"and {exc}; nothing can replay this layout's step to tell which are "
                    "right, so the job stops before the update, its last committed step "
                    "intact (three or more replica groups give a majority)") from None
            else:
                found, how = None, ("differed from what a replay of the step's collectives "
                                    "gave every rank")
        if not broken and found == {} and split is None:
            self._vouched = max(self._vouched, st.index - 1)
            return
        if rolls and (found or split is not None):  # (a seal alone: its snapshot is whole)
            self._roll_back(st, state, broken, {
                r: f"rank {r}'s {keys[i]} (step {st.index}) {how}"
                for i, ranks in found.items() for r in ranks}, split)
        if gathered is not None:
            gathered()
            self._undo(st, state)
        if found is None:
            found = self._replay(st.index, state, first, total)
        named = {r: f"rank {r}'s {keys[i]} (step {st.index}) {how}"
                 for i, ranks in found.items() for r in ranks}
        self._act(st, state, broken, named, voted=True)

    def _roll_back(self, st: Step, state: RankState, broken: dict[int, int],
                   named: dict[int, str], split: str | None) -> None:
        """The carried vote, or a layout whose vote rolls back (`VoteScope.rolls_back`: tp
        copies), found state that differs at step `st`: what differs came from step
        st.index - 1 (its update, or memory since), so that step's snapshot may hold it
        too (on any rank of a pair that cannot outvote each other). The job goes back to
        snapshot st.index - 2, the last one a vote vouched for: the reporting rank (the
        lowest healthy one, as `_act`'s) takes back snapshot st.index - 1's commit
        (`Snapshotter.retract`, which also keeps any acknowledgement still to come from
        committing it) and reports; every rank marks its state
        as of st.index - 2, so the next join restores that step from the snapshots every
        rank still holds (the one after it is never begun before this step's update). A
        rank outside a strict majority, or whose seal broke, is replaced (`_act`);
        otherwise the leader starts the next generation with the same members
        (`ReportKind.ROLLBACK`). Raises `consensus.Outvoted` or `consensus.RolledBack`."""
        member = self.member
        bad = set(broken) | set(named)
        to = st.index - 2
        reporter = min((r for r in range(member.world_size) if r not in bad), default=-1)
        if to < 0 or not member.store.check([Keys.commit(to)]):
            raise consensus.NoMajority(
                f"step {st.index}: the copies the ranks must hold alike differ "
                f"({split or '; '.join(named.values())}) and step {to} has no committed "
                "snapshot to roll back to (snapshots off, or too early in the job); the job "
                "stops before the update")
        if member.rank == reporter:
            if not bad and member.store.add(Keys.rollback(to), 1) > 1:
                raise consensus.NoMajority(
                    f"step {st.index}: the copies differ again after a rollback to step {to} "
                    f"({split}): a fault that persists on one of these ranks, and no strict "
                    "majority says which; the job stops before the update (give the job "
                    "three copies to vote with: more ranks, or replica groups)")
            if not member.snap.retract(member.store, st.index - 1, to):
                self.events.emit("retract_unconfirmed", rank=member.rank, step=st.index - 1,
                                 to_step=to, why="its last acknowledgement reached the count "
                                 "and its commit marker never came: an acker that died then "
                                 "(or one still alive may commit it anew)")
        state.step = to
        why = f"step {st.index}: {split or '; '.join(named.values())}"
        if member.rank == reporter:
            self.events.emit("fingerprint_rollback", rank=member.rank, gen=member.generation,
                             step=st.index, to_step=to, why=why, named=sorted(named))
        if bad:
            self._act(st, state, broken, named, voted=True)
        if member.rank == reporter:
            member.report(ReportKind.ROLLBACK, f"roll back to step {to}: {why}")
        raise consensus.RolledBack(f"{why}; rolled back to step {to}")

    def _undo(self, st: Step, state: RankState) -> None:
        """Put back this rank's unique state of step st.index - 1 from its own snapshot
        (the optimizer step of `st` ran) and gather the parameters again: the step is then
        as before its update and the recovery keeps its microbatches. Without that
        snapshot in its own slot (a spare that restored from a peer's, a skipped
        snapshot) the step stays in its update phase, and the recovery restores this rank
        from the committed step st.index - 1."""
        member = self.member
        try:
            own = member.snap.own(st.index - 1)
            state.layout.state.load_unique(own.tensors, own.header.opt)
            st.phase = StepPhase.REDUCE
        except IntegrityError as exc:
            member.events.emit("fingerprint_undo_failed", rank=member.rank, step=st.index,
                               error=str(exc)[:300])
        # (every rank, so the collective matches)
        state.layout.state.gather_params(member.ops, f"parameter all-gather (step {st.index} undone)")

    def _act(self, st: Step, state: RankState, broken: dict[int, int], named: dict[int, str],
             voted: bool) -> None:
        """Report the ranks found (`broken`: rank -> its seal's mask; `named` by the vote)
        and abandon the step: by the lowest healthy rank after a vote, by the rank itself
        when its seal broke on a step without one."""
        member = self.member
        rank, world = member.rank, member.world_size
        names = sorted(state.layout.state.unique_tensors())
        bad = {r: (f"rank {r}'s optimizer state changed in memory after snapshot "
                   f"{st.index - 1} was copied "
                   f"({', '.join(n for i, n in enumerate(names) if m >> i & 1)})")
               for r, m in broken.items()}
        for r, why in named.items():
            bad.setdefault(r, why)
        healthy = [r for r in range(world) if r not in bad]
        consensus.name_ranks(member, self.events, "fingerprint_mismatch", st.index, bad,
                             rank == (min(healthy or bad) if voted else rank), field="outvoted")

    def _replay(self, index: int, state: RankState, tally: list[list[int]],
                total: int) -> dict[int, list[int]]:
        """No strict majority: run the step's collectives again from what they were
        computed from, digest again and name the ranks whose first digest differs from
        the one all now agree on (`consensus.replayed`). The gradient all-reduce is redone
        over a buffer of the first one's length, so each element is summed in the same
        order (a ring all-reduce's chunks follow the length) and bit for bit alike; the
        parameters are all-gathered again from the master shards (which also repairs a
        rank's damaged copy)."""
        member, lay = self.member, state.layout
        t0 = time.perf_counter()
        g = torch.zeros(total, dtype=lay.math.master_dtype, device=lay.math.device)
        lay.math.write_grads(g[:lay.math.grad_numel()])
        member.ops.allreduce(g, f"replayed gradient all-reduce (step {index})")
        lay.state.gather_params(member.ops, f"replayed parameter all-gather (step {index})")
        replayed = lay.vote.fingerprinted(g[:lay.math.grad_numel()])
        again = [consensus.digest_all(ts) for ts in replayed.values()]
        now = consensus.exchange(member.ops, member.rank, member.world_size, again,
                                 f"replayed fingerprint vote (step {index})")
        self.events.emit("fingerprint_replay", rank=member.rank, gen=member.generation,
                         step=index, first=tally, replayed=now,
                         seconds=round(time.perf_counter() - t0, 4))
        return consensus.replayed(tally, now)
