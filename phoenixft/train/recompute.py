"""Faults in the arithmetic, found by sampled recomputation (`--recompute-every K`).

A fault in a rank's arithmetic (a defective core, a bad kernel on one device) makes its
local gradient wrong; the step's all-reduce then sums the wrong contribution into every
rank's gradient alike, so every rank agrees on the wrong result and the fingerprint vote
(`consensus.py`) cannot see it. On every K-th step (not a retried one) each rank also
recomputes the first microbatch of each of the two ranks before it in `ring` order (the
nodes interleaved, so they sit on other nodes where the job has several):
`Step.microbatches()` yields those ids first, their backward is digested and thrown away
(the gradients are zeroed after each), and then the rank's own microbatches run, the
first of which it digests as well. So each checked microbatch's gradient is computed three
times, on three ranks, from the same parameters and the same data. The digests ride in
one tiny all-reduce, before the update; for each microbatch a strict majority of the
three names the rank that differs (`judge`), which is reported CORRUPT and replaced like a
dead rank before the step's update, the others keeping their microbatches.

A plain FSDP2 model reduce-scatters each microbatch's gradient inside its backward, so
there (`StepMath.own_checked_apart`) the rank's own first microbatch is recomputed too, as
a third check pass, and the check passes run in FSDP2's no-sync mode (`check_pass`):
their forward passes still all-gather (every rank runs three), their backward leaves the
unsharded gradient on the rank to digest and drop.

What it needs: data parallelism or plain FSDP2 (each check's gradient this rank's own),
the user's loop running the microbatches, three ranks or more, and each microbatch's
gradient a pure function of the parameters and its data: the data drawn from (step,
microbatch id), no unseeded randomness (dropout), and kernels that give the same bits
for the same inputs (on CUDA: `torch.use_deterministic_algorithms(True)`; some backward
kernels, such as scatter-add and fused attention's, do not otherwise). What it catches: a
fault that
corrupts the checked microbatches' gradients on a check step (a persistent one, on the
first check step after it begins: the steps before that check are not undone; a fault
on one microbatch only, with probability 1 / (K x the rank's microbatches)). Its cost:
two more forward and backward passes per rank every K steps (three with FSDP2), three
gradient digests and one all-reduce of 3 integers a rank.
"""

from __future__ import annotations

import time
from collections import Counter

from phoenixft.observe.events import EventLog
from phoenixft.train import consensus
from phoenixft.train.rank_state import RankState
from phoenixft.train.step import Step

NONE = consensus.NONE  # (a rank that computed no such microbatch)
CHECKERS = 2  # each checked microbatch is recomputed by this many other ranks


def ring(nodes: dict[int, int], world: int) -> list[int]:
    """The ranks in the order checks follow: the nodes interleaved (each node's first rank,
    then each node's second, ...), so the ranks a microbatch is recomputed on sit on other
    nodes than its own wherever the job has several: a fault shared by a node (its driver,
    its host) is not outvoted by itself, and two neighbours on one node cannot outvote a
    healthy rank of another."""
    seen: dict[int, int] = {}
    place = {}
    for r in range(world):
        n = nodes.get(r, 0)
        place[r] = (seen.get(n, 0), n, r)
        seen[n] = seen.get(n, 0) + 1
    return sorted(range(world), key=place.__getitem__)


def checks_of(rank: int, order: list[int]) -> list[int]:
    """The ranks whose first microbatch `rank` recomputes: the two before it in `order`."""
    i, world = order.index(rank), len(order)
    return [order[(i - k) % world] for k in range(1, CHECKERS + 1)]


def judge(tally: list[list[int]], order: list[int]) -> tuple[dict[int, str], list[str]]:
    """`tally`: per rank r, [its own first microbatch's digest, its digests of
    `checks_of(r, order)`'s first microbatches] (NONE where there was none). For each rank a
    whose first microbatch was computed three times (a's own and its two checkers'), the
    ranks outside a strict majority are named, with why. Returns (named, undecided): a
    microbatch whose three computations all differ names nobody (a fault on two of its
    three ranks at once) and is said in `undecided`."""
    named: dict[int, str] = {}
    undecided: list[str] = []
    world = len(order)
    for i, a in enumerate(order):
        votes = {a: tally[a][0]}
        for k in range(1, CHECKERS + 1):  # (its k-th check is the rank k before it)
            c = order[(i + k) % world]
            if c != a:
                votes[c] = tally[c][k]
        if len(votes) < 1 + CHECKERS or NONE in votes.values():
            continue  # not computed three times on this step (a retried step, two ranks)
        value, n = Counter(votes.values()).most_common(1)[0]
        if n == len(votes):
            continue
        if 2 * n <= len(votes):
            undecided.append(f"rank {a}'s first microbatch: no strict majority among "
                             + ", ".join(f"rank {r}: {v:#x}" for r, v in votes.items()))
            continue
        for r, v in votes.items():
            if v != value:
                whose = "its own" if r == a else f"rank {a}'s"
                named.setdefault(r, f"rank {r}'s gradient of {whose} first microbatch "
                                    f"({v:#x}) differs from the {n} other computations of it "
                                    f"({value:#x})")
    return named, undecided


class Recomputer:
    """The session's side: which ids a step recomputes (`plan`), the digests taken after
    a check's backward (`checked`) and after the rank's own first one (`backward`), and
    the verdict after the step's all-reduce (`verdict`: raises `Outvoted` when a rank is
    named, `NoMajority` when a microbatch has none)."""

    def __init__(self, every: int, member, events: EventLog) -> None:
        self.every, self.member, self.events = every, member, events
        # this step's checks on the critical path (0: not a check step): the recomputed
        # passes, the digests and the exchange
        self.check_s = 0.0
        self._paused = -1  # the generation whose too few ranks were said
        self._apart = False  # the check passes' gradients are kept apart now (`phase`)

    def due(self, index: int) -> bool:
        return bool(self.every) and index % self.every == 0

    def order(self) -> list[int]:
        plan = self.member.plan
        return ring(plan.nodes, plan.world_size)

    def plan(self, st: Step, plan: list[list[int]], rank: int, state: RankState) -> None:
        """A step's first attempt: on a check step, the first microbatch id of each rank
        `checks_of(rank)` (None where it has none), to be computed before its own; and
        where the layout reduces a microbatch's gradient inside its backward
        (`own_checked_apart`: plain FSDP2), this rank's own first id as a third check."""
        st.check_ids, st.check_digests, st.own_digest = [], [], NONE
        world = len(plan)
        if not self.due(st.index) or world < 1 + CHECKERS:
            return
        st.check_ids = [plan[r][0] if plan[r] else None for r in checks_of(rank, self.order())]
        st.check_digests = [NONE] * len(st.check_ids)
        if state.layout.math.own_checked_apart:
            st.check_ids.append(plan[rank][0])

    def phase(self, state: RankState, on: bool) -> None:
        """The check passes begin (on) or the rank's own passes do: a layout that reduces
        inside backward keeps the check passes' gradients on this rank (`check_pass`)."""
        if on != self._apart:
            self._apart = on
            state.layout.math.check_pass(on)

    def checked(self, st: Step, state: RankState) -> None:
        """A check's backward just ran: digest its gradient and drop it (the rank's own
        first microbatch's, where it is recomputed apart, is its own digest)."""
        math = state.layout.math
        digest = self._digest(math.check_gradients(state.model))
        if st.check_index < CHECKERS:
            st.check_digests[st.check_index] = digest
        else:
            st.own_digest = digest
        math.drop_check_gradients(state.model)
        # (its forward and backward in the user's loop, and the digest)
        self.check_s += time.perf_counter() - st.check_t0

    def backward(self, st: Step, state: RankState) -> None:
        """One of the rank's own microbatches' backward just ran: the first one's gradient
        is digested, unless it was recomputed apart."""
        if st.check_ids and len(st.done) == 1 and not state.layout.math.own_checked_apart:
            t0 = time.perf_counter()
            st.own_digest = self._digest(state.layout.math.check_gradients(state.model))
            self.check_s += time.perf_counter() - t0

    def loss(self, loss):
        """`wrong`: this worker's arithmetic is off: every gradient it computes comes out
        wrong (its loss scaled before backward, so the fault reaches a sharded model's
        reduce-scatter as it does a data-parallel rank's accumulated gradient)."""
        return loss * 1.25 if self.member.wrong else loss

    @staticmethod
    def _digest(grads: list) -> int:
        # (>= 0: a device's digest, an exact integer sum, may be negative, or NONE)
        return consensus.digest_all(grads) & (2 ** 63 - 1) if grads else NONE

    def verdict(self, st: Step) -> None:
        """After the step's all-reduce, before its update, on every rank of a check step
        (a retried one too, whose digests are NONE: the exchange is collective)."""
        if not self.due(st.index):
            return
        member = self.member
        rank, world = member.rank, member.world_size
        if world < 1 + CHECKERS:
            if rank == 0 and self._paused != member.generation:
                self._paused = member.generation  # said once a generation
                self.events.emit("recompute_paused", gen=member.generation, step=st.index,
                                 world_size=world, reason=f"{world} ranks: a microbatch is "
                                 f"checked on {1 + CHECKERS}")
            return
        t0 = time.perf_counter()
        mine = [st.own_digest, *st.check_digests]
        if len(mine) != 1 + CHECKERS or st.retry:
            mine = [NONE] * (1 + CHECKERS)
        cols = consensus.exchange(member.ops, rank, world, mine,
                                  f"recomputation digests (step {st.index})")
        self.check_s += time.perf_counter() - t0
        named, undecided = judge([list(x) for x in zip(*cols)], self.order())
        if named:
            consensus.name_ranks(member, self.events, "recompute_mismatch", st.index, named,
                                 rank == min((r for r in range(world) if r not in named),
                                             default=min(named)))
        if undecided:
            raise consensus.NoMajority(
                f"step {st.index}: the recomputed gradients disagree and {'; '.join(undecided)}"
                "; the job stops before the update, its last committed step intact")
