"""The session's side of consensus (`consensus.py` has the digests, the tally and the
seal): what a rank checks before the step's all-reduce, and the vote after it.

Before the all-reduce each rank checks its own seal (its unique state against the hashes
the snapshot thread took once the last snapshot was copied) and puts a bit mask of what
changed in its slot of the all-reduce, so every rank learns it with the gradients. After
the all-reduce, every `--fingerprint-every` steps, the ranks vote on digests of the
reduced gradients and of the parameters; with no strict majority the step's collectives
are replayed. Ranks named either way are reported to the leader (CORRUPT: it fences and
replaces them, and quarantines the worker) and the step is abandoned before its update,
like one whose peer died: the others keep their microbatches.
"""

from __future__ import annotations

import time

import torch

from phoenixft.cluster.keys import ReportKind
from phoenixft.config import Fingerprints
from phoenixft.observe.events import EventLog
from phoenixft.train import consensus
from phoenixft.train.rank_state import RankState


class Fingerprinter:
    def __init__(self, cfg: Fingerprints, member, events: EventLog) -> None:
        self.cfg = cfg
        self.member = member
        self.events = events
        # this step's costs on the critical path (0: not done this step): the seal check,
        # the digests, and the digests plus the vote's all-reduce (which includes waiting
        # for the slowest rank); the step event carries them
        self.seal_s = self.digest_s = self.vote_s = 0.0

    def costs(self) -> dict[str, float]:
        return {"vote_s": round(self.vote_s, 6), "digest_s": round(self.digest_s, 6),
                "seal_s": round(self.seal_s, 6)}

    def seal_mask(self, state: RankState) -> float:
        """With fingerprints and snapshots on: which of this rank's unique tensors (its
        optimizer shard) changed since its last snapshot was copied and sealed, as a bit
        mask over their sorted names (0: none, or no seal to check); checked before the
        step's all-reduce, every step (the state is about to be used). Waits for that
        copy, as the optimizer's pre-hook would."""
        member = self.member
        self.seal_s = 0.0
        if not self.cfg.every or member.snap is None:
            return 0.0
        member.snap.wait_copied()
        t0 = time.perf_counter()
        changed = member.seal.check(state.step, state.layout.unique_tensors())
        if changed is None:
            return 0.0
        self.seal_s = time.perf_counter() - t0
        names = sorted(state.layout.unique_tensors())
        return float(sum(1 << min(names.index(n), 23) for n in set(changed)))

    def vote(self, index: int, state: RankState, grads: torch.Tensor, total: int,
             broken: dict[int, int]) -> None:
        """Step `index`, all-reduced (`grads`: the reduced gradient region, at the start
        of a buffer of `total` elements): the vote, when its turn; raises
        `consensus.Outvoted` when a rank is named (or `broken`: rank -> its seal's mask),
        `consensus.NoMajority` when nobody can be."""
        self.vote_s = self.digest_s = 0.0
        member = self.member
        rank, world = member.rank, member.world_size
        prior = index - 1
        names = sorted(state.layout.unique_tensors()) if broken else []
        bad = {r: f"rank {r}'s optimizer state changed in memory after snapshot {prior} "
                  f"was copied ({', '.join(n for i, n in enumerate(names) if mask >> i & 1)})"
               for r, mask in broken.items()}
        # (local_gradients: the step's all-reduce is where the ranks' gradients meet)
        if self.cfg.every and not index % self.cfg.every and world >= 2 and \
                state.layout.local_gradients:
            t0 = time.perf_counter()
            parts = {"reduced gradients": grads}
            params = state.layout.replicated()
            if params is not None:
                parts[f"parameters after step {prior}"] = params
            mine = [consensus.digest(t) for t in parts.values()]
            self.digest_s = time.perf_counter() - t0
            what = f"fingerprint vote (step {index})"
            tally = consensus.exchange(member.ops, rank, world, mine, what)
            self.vote_s = time.perf_counter() - t0
            try:
                out, how = consensus.outliers(tally), "differ from the majority's"
            except consensus.NoMajority:
                out = self._replay(index, state, tally, total, params is not None)
                how = "differed from what a replay of the step's collectives gave every rank"
            keys = list(parts)
            for i, ranks in out.items():
                for r in ranks:
                    bad.setdefault(r, f"rank {r}'s {keys[i]} (step {index}) {how}")
        if not bad:
            return
        members = member.plan.members
        healthy = [r for r in range(world) if r not in bad]
        if rank == min(healthy or bad):
            named = sorted(bad)
            self.events.emit("fingerprint_mismatch", rank=rank, gen=member.generation,
                             step=index, outvoted=named, wids=[members[r] for r in named],
                             found=[bad[r] for r in named])
            for r in named:
                member.report(ReportKind.CORRUPT, bad[r], wid=members[r])
        raise consensus.Outvoted(f"step {index}: {'; '.join(bad.values())}")

    def _replay(self, index: int, state: RankState, tally: list[list[int]], total: int,
                params: bool) -> dict[int, list[int]]:
        """No strict majority: run the step's collectives again from what they were
        computed from, digest again and name the ranks whose first digest differs from
        the one all now agree on (`consensus.replayed`). The gradient all-reduce is redone
        over a buffer of the first one's length, so each element is summed in the same
        order (a ring all-reduce's chunks follow the length) and bit for bit alike; the
        parameters are all-gathered again from the master shards (which also repairs a
        rank's damaged copy)."""
        member, lay = self.member, state.layout
        t0 = time.perf_counter()
        g = torch.zeros(total, dtype=lay.master_dtype, device=lay.device)
        lay.write_grads(g[:lay.grad_numel()])
        member.ops.allreduce(g, f"replayed gradient all-reduce (step {index})")
        again = [consensus.digest(g[:lay.grad_numel()])]
        if params:
            lay.gather_params(member.ops, f"replayed parameter all-gather (step {index})")
            again.append(consensus.digest(lay.replicated()))
        now = consensus.exchange(member.ops, member.rank, member.world_size, again,
                                 f"replayed fingerprint vote (step {index})")
        self.events.emit("fingerprint_replay", rank=member.rank, gen=member.generation,
                         step=index, first=tally, replayed=now,
                         seconds=round(time.perf_counter() - t0, 4))
        return consensus.replayed(tally, now)
