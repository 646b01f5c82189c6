"""The training session: the user API, and the one place that knows the user's model and
optimizer.

    sess = phoenixft.Session()                       # reads what `phoenixft run` set
    model = build_model()
    sess.setup(model, lambda p: torch.optim.AdamW(p, lr=3e-4), track={"data": sampler})
    for step in sess.steps(1000):                    # spares wait in setup() until needed
        for mb in step.microbatches():
            x, y = sampler.batch()
            step.backward(F.cross_entropy(model(x).flatten(0, 1), y.flatten()))

The session runs the step: one all-reduce of a flat buffer (gradients, the microbatch
audit, loss; `reduce_layout.py`) with a deadline, the optimizer update of the rank's
`Layout` (ZeRO-1 over a flat buffer: `flat_layout.py`), and a snapshot started in
the background. Everything about
generations (joining, recovering, spares) is the `Member`'s; what a rank holds is its
`RankState`. When a collective fails or the leader publishes a new generation, the
member recovers and the loop resumes at the restored step. Survivors are never restarted.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

import phoenixft.torch_internals as ti
from phoenixft.cluster import store as kv
from phoenixft.cluster.heartbeat import HeartbeatSender, beats_dir
from phoenixft.cluster.keys import Keys
from phoenixft.cluster.membership import Plan
from phoenixft.cluster.protocol import register_worker
from phoenixft.comm.collectives import CommFailure
from phoenixft.config import ConfigError, StragglerAction
from phoenixft.observe.events import EventLog
from phoenixft.train import model_io, quota, recompute
from phoenixft.train.config import SessionConfig
from phoenixft.train.digest import state_digest
from phoenixft.train.fingerprints import Fingerprinter
from phoenixft.train.fsdp_layout import Parallelize
from phoenixft.train.layouts import LayoutArgs, build
from phoenixft.train.lifecycle import JobAborted, stop_at_exit
from phoenixft.train.member import Member
from phoenixft.train.pipeline_schedule import Pipeline
from phoenixft.train.rank_state import RankState
from phoenixft.train.recompute import Recomputer
from phoenixft.train.reduce_layout import ReduceLayout
from phoenixft.train.step import Step, StepPhase
from phoenixft.train.straggler import StragglerReporter
from phoenixft.train.tracked import Tracked
from phoenixft.train.zero import SchedulerFactory

__all__ = ["JobAborted", "Session"]


class Session:
    """A training job's user API: wrap a plain PyTorch loop and phoenixft runs the step
    (gradient reduction, the optimizer update through the rank's `Layout`, a
    snapshot in the background) and survives failures underneath it.

    Under `phoenixft run` it reads its place from the environment; without it, it is a
    standalone one-process session (notebooks, tests). `setup(model, optimizer_factory)`
    registers the model (a warm spare waits there until it is needed); `steps(N)`
    yields `Step`s until N optimizer steps are done, recovering in between (survivors
    are never restarted: after a failure the loop simply resumes at the restored step);
    `full_state()`, `save_pretrained()` and `load_state()` read and write the model.
    What a rank holds is its `RankState`; the generation protocol is its `Member`."""

    def __init__(self, config: SessionConfig | None = None) -> None:
        self.cfg = config or SessionConfig.from_env()
        self.wid = self.cfg.worker_id
        self._own_store = None
        if self.cfg.store is None:  # standalone: host a private store, lead ourselves
            self._own_store, port = kv.host_store("127.0.0.1")
            self.cfg.store = f"127.0.0.1:{port}"
        self.store = kv.connect(self.cfg.store)
        self._heartbeat: HeartbeatSender | None = None
        self.events = EventLog(Path(self.cfg.run_dir) / "events.jsonl" if self.cfg.run_dir else None,
                               wid=self.wid)
        self.member = Member(self.cfg, store=self.store, events=self.events,
                             make_step=self._new_step, led=self._own_store is None)
        stop_at_exit(self.close)
        self.state: RankState | None = None
        self._pending: Step | None = None
        self._current: Step | None = None  # the step the user's loop body is in
        self._grow_requested = False
        self._stragglers = StragglerReporter(self.cfg.stragglers, self.events)
        self._fingerprints = Fingerprinter(self.cfg.fingerprints, self.member, self.events)
        self._recompute = Recomputer(self.cfg.fingerprints.recompute_every, self.member,
                                     self.events)
        self.final_digest: str | None = None
        if self._own_store is None:  # its agent watches it (a standalone one has nobody)
            self._heartbeat = HeartbeatSender(beats_dir(self.cfg.shm_dir), self.wid,
                                              self.cfg.timeouts.heartbeat_interval_s).start()
        register_worker(self.store, self.wid, self.cfg.node, os.getpid())
        if self._own_store is not None:
            plan = Plan(generation=0, members={0: self.wid}, nodes={0: self.cfg.node})
            self.store.set(Keys.plan(0), plan.to_json())

    # -- public API -----------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This worker's rank in the current generation (-1 while a spare waits)."""
        return self.member.rank

    @property
    def world_size(self) -> int:
        return self.member.world_size

    @property
    def generation(self) -> int:
        return self.member.generation

    @property
    def step(self) -> int:
        """Optimizer steps completed (restored ones included)."""
        return self.state.step if self.state is not None else 0

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer running on this rank's shard (for LR schedulers)."""
        if self.state is None or not self.state.joined:
            raise RuntimeError("call Session.setup() first")
        return self.state.layout.math.optimizer

    @property
    def scheduler(self):
        """The LR scheduler built by `setup(scheduler=...)` on this rank's optimizer, or None."""
        if self.state is None or not self.state.joined:
            raise RuntimeError("call Session.setup() first")
        return self.state.layout.math.scheduler

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def setup(self, model: nn.Module,
              optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
              *, scheduler: SchedulerFactory | None = None,
              track: dict[str, object] | None = None, microbatches: int | None = None,
              parallelize: Parallelize | None = None, tp: int = 1,
              dp_shard: int | None = None, pipeline: Pipeline | None = None) -> None:
        """Register the model, the optimizer factory, an optional LR scheduler factory
        (`lambda opt: CosineAnnealingLR(opt, T_max=...)`, stepped after every optimizer
        step; its state is snapshotted and restored with the optimizer's) and any extra
        per-rank state (data loaders, samplers, generators). `microbatches` is M, the
        microbatches of every step (default: one per data-parallel rank at the start).
        `parallelize(model, mesh)`: shard the model with FSDP2 (`fully_shard` per block,
        then the root) over the DeviceMesh phoenixft gives (dimension "dp_shard"); the
        optimizer is then built on its DTensor parameters (`fsdp_layout.py`). `tp` > 1
        makes the mesh two-dimensional, ("dp_shard", "tp"), with groups of `tp`
        consecutive ranks for tensor parallelism (`parallelize_module` over mesh["tp"]),
        each group computing the same microbatches. `dp_shard` (with `parallelize`): HSDP,
        replica groups of dp_shard x tp ranks, FSDP2 inside each (the mesh is the
        group's), gradients averaged across groups by phoenixft, a group the unit of
        failure (`hsdp_layout.py`); None: one group of every rank. Without `parallelize`
        the session runs ZeRO-1 over a flat copy of the parameters (`flat_layout.py`).
        `pipeline` (`phoenixft.Pipeline(pp=..., split=..., loss_fn=..., schedule=...)`):
        pipeline parallelism, replicas of `pp` stages of `dp_shard` (default 1) FSDP2 ranks;
        the loop body is `step.run_schedule(batch)` (`pipeline_layout.py`).
        Spares block here until activated."""
        if microbatches is not None and microbatches < 1:
            raise ValueError(f"microbatches must be >= 1, got {microbatches}")
        tracked = Tracked()
        for name, obj in (track or {}).items():
            tracked.add(name, obj)
        if tp != 1 and parallelize is None and pipeline is None:
            raise ValueError(f"tp={tp} needs parallelize=: tensor parallelism is the "
                             "user's parallelize_module over the mesh phoenixft gives")
        if dp_shard is not None and parallelize is None and pipeline is None:
            raise ValueError(f"dp_shard={dp_shard} needs parallelize=: the replica groups "
                             "shard the model with FSDP2")
        if (parallelize is not None or pipeline is not None) \
                and self.cfg.stragglers.action is StragglerAction.REBALANCE:
            raise ConfigError("--straggler rebalance gives ranks different numbers of "
                             "microbatches, and a sharded model's ranks must run as many "
                             "passes (FSDP2's collectives): use --straggler swap or report")
        layout = build(LayoutArgs(model=model, optimizer=optimizer, scheduler=scheduler,
                                  parallelize=parallelize, tp=tp, dp_shard=dp_shard,
                                  pipeline=pipeline, before_reduce_scatter=self._in_backward,
                                  before_p2p=self._in_p2p))
        if layout.work.leaves_whole is not None:  # the leader drops whole groups
            self.store.set(Keys.UNIT, str(layout.work.leaves_whole))
        self.state = RankState(model=model, layout=layout,
                               tracked=tracked, policy=self.cfg.policy, m=microbatches or 0)
        self._warm_up(optimizer)
        self._pending = self.member.start(self.state)
        self._check_min_world(layout)
        action = self.cfg.stragglers.action
        if action is not StragglerAction.OFF and self.world_size > 1 and all(
                len(c) < 2 for c in layout.work.peer_classes(self.world_size)):
            why = ("a rank is compared with the ranks that do the same work (a pipeline stage "
                   "with the same stage of the other replicas), and this job has one of each")
            if action is not StragglerAction.REPORT:  # (report is the default: said, not refused)
                raise ConfigError(f"--straggler {action}: {why}: run 2 pipeline replicas at "
                                  "least, or --straggler report|off")
            if self.rank == 0:
                self.events.emit("stragglers_unwatched", reason=why)
        self._check_recompute(layout)
        m = self.state.m_for(self.world_size)
        lay = self.state.layout
        # which of this rank's gradients and parameters a vote can compare with a copy
        votes = lay.vote.finds() if (
            bool(self.cfg.fingerprints.every)
            and lay.vote.fingerprinted(torch.empty(0)) is not None
            and any(len(c) > 1 for c in lay.vote.vote_classes(self.world_size))) else frozenset()
        # (a garble is checked against the job's first placement: a spare or a respawned
        # worker sets up later, when the ranks that receive replicas may have changed)
        self.member.injector.check_plan(
            [len(ids) for ids in lay.work.plan(m, self.world_size)],
            receivers=self.member.replica_receivers() if self.generation == 0 else None,
            votes=votes, layout_phases=lay.members.fault_phases(),
            user_loop=lay.executor.user_loop)

    def _check_recompute(self, layout) -> None:
        """`--recompute-every` where it cannot take effect is refused at set-up."""
        if not self.cfg.fingerprints.recompute_every:
            return
        if not layout.executor.user_loop:
            why = ("it recomputes a peer's microbatch in this rank's own loop, and a "
                   "pipelined job's schedule runs its microbatches itself")
        else:
            why = layout.math.recompute_refusal()
        if why is None and self.state.initial_world < 1 + recompute.CHECKERS:
            # (the job's first size: a spare joining after a shrink to fewer goes on, and
            # the checks pause, said by a `recompute_paused` event)
            why = (f"each checked microbatch is computed on {1 + recompute.CHECKERS} ranks, so "
                   f"a majority names the one that differs; this job has "
                   f"{self.state.initial_world}")
        if why is not None:
            raise ConfigError(f"--recompute-every {self.cfg.fingerprints.recompute_every}: "
                              f"{why}; or leave it off (0)")

    def _check_min_world(self, layout) -> None:
        """`--min-nproc` that this layout can never shrink to is refused at set-up, not at
        the first failure: a plain FSDP2 model keeps its world size (its shards were cut
        for it), and HSDP's replica groups leave whole."""
        m = kv.get_int(self.store, Keys.MIN_WORLD, -1) if self.store is not None else -1
        world = self.world_size
        if m < 0 or m >= world:
            return
        why = layout.work.min_world_error(m, world)
        if why is not None:
            raise ConfigError(why)

    def _warm_up(self, factory) -> None:
        """Pay lazy imports and first-call costs now, not on activation: constructing and
        stepping a torch optimizer the first time imports torch's dynamo (~2 s here)."""
        lay = self.state.layout
        p = nn.Parameter(torch.zeros(8, dtype=lay.math.master_dtype, device=lay.math.device))
        opt = factory([p])
        p.grad = torch.zeros_like(p)
        opt.step()
        state_digest({"warm": p.detach()})

    def steps(self, total: int) -> Iterator[Step]:
        """Yield steps until `total` optimizer steps are done, recovering from failures."""
        if self.state is None or not self.state.joined:
            raise RuntimeError("call Session.setup() before Session.steps()")
        state, member = self.state, self.member
        while True:
            if state.step >= total:
                if self._pending is not None and self._pending.speculative is not None:
                    # a spare activated by the checks after the last step computed ahead
                    # from the last snapshot: nothing is left to compute, it joins
                    st, self._pending = self._pending, None
                    self._pending = member.enter(member.plan, state, st)
                    continue
                try:
                    self._finish()
                    return
                except CommFailure as exc:
                    self._pending = member.recover(exc, state, None)
                    continue
            st, self._pending = self._pending, None
            if st is None:
                m = state.m_for(self.world_size)
                plan = self._plan(m)
                st = self._new_step(state.step + 1, plan[self.rank], m)
                self._recompute.plan(st, plan, self.rank, state)
                member.injector.at_step(self.rank, st.index)
            self._current = st
            self._stragglers.start(self.generation)
            self._recompute.check_s = 0.0
            state.layout.executor.blocked_s()  # (counted from the step's start)
            yield st
            self._current = None
            try:
                if st.speculative is not None:  # a spare computed it ahead: join now
                    self._pending = member.enter(member.plan, state, st)
                    continue
                self._complete(st)
            except CommFailure as exc:
                self._grow_requested = False  # (asked of the generation just left)
                self._pending = member.recover(exc, state, st)
                continue
            if self._grow_requested:
                self._grow_requested = False
                self._pending = member.hand_over_for_growth(state)

    def full_state(self) -> dict[str, torch.Tensor]:
        """Collective: the whole model and (unsharded) optimizer state, world-size free."""
        return self.state.layout.state.full_state(self.member.ops)

    def load_state(self, source, *, strict: bool = True) -> None:
        """Start from existing weights: a Hugging Face directory (model.safetensors or a
        sharded index), a .safetensors file, or a state dict. Call it on every worker,
        before or after `setup` (not once steps run); `model` is the one given to setup,
        or pass it before setup with `load_state((model, source))`."""
        if isinstance(source, tuple):
            model, source = source
        elif self.state is not None:
            model = self.state.model
        else:
            raise RuntimeError("before setup(), call load_state((model, source))")
        model_io.load_weights(model, source, strict=strict)
        if self.state is not None:
            self.state.layout.state.params_changed()

    def save_pretrained(self, out_dir: str | Path, *, tokenizer=None) -> Path | None:
        """Write the trained model as a Hugging Face directory (config.json when the model
        has a config, model.safetensors, and the tokenizer's files when one is given).
        Every rank holds the full parameters, so rank 0 writes and the others return None."""
        if self.state is None:
            raise RuntimeError("call Session.setup() first")
        if self.rank != 0:
            return None
        return model_io.save_pretrained(self.state.model, out_dir, tokenizer=tokenizer,
                                        aliases=self.state.aliases())

    def close(self) -> None:
        """Stop this session's background threads and, standalone, its private store
        (also done at process exit): nothing of it runs while the interpreter tears down."""
        if self._heartbeat is not None:
            self._heartbeat.stop(join_timeout_s=2.0)
        self._stragglers.stop()
        self.member.shutdown(join_timeout_s=2.0)
        self._own_store = None

    def log(self, event: str, **fields) -> None:
        self.events.emit(event, rank=self.rank, gen=self.generation, **fields)

    # -- the step -------------------------------------------------------------------
    def _flip(self, st: Step, where: str, grads: torch.Tensor | None = None) -> None:
        """An injected `flip:...:where=W` lands here when it fires (step `st`): one bit of
        this rank's reduced gradients (`grads`), parameters or optimizer state."""
        if not self.member.injector.flips(self.rank, st.index, where):
            return
        lay = self.state.layout
        parts = list((lay.vote.fingerprinted(grads if grads is not None else torch.empty(0))
                      or {}).values())
        if where == "grad":  # (a sharded model's reduced gradients are its parameters')
            t = parts[0][0] if parts and parts[0] else grads
            if t is None or not t.numel():
                t = next(ti.local(p.grad) for p in self.state.model.parameters()
                         if p.grad is not None and ti.local(p.grad).numel())
        elif where == "param":
            t = parts[1][0] if len(parts) > 1 else next(
                ti.local(p) for p in self.state.model.parameters() if p.numel())
        else:
            if self.member.snap is not None:
                self.member.snap.wait_copied()  # at rest: after snapshot T's copy
            t = next((v for k, v in lay.state.unique_tensors().items()
                      if k.startswith(("opt.", "o.")) and v.dim() > 0), None)
            if t is None:
                raise RuntimeError(f"flip:where=optim at step {st.index}: this rank holds no "
                                   "per-element optimizer state to flip (SGD without "
                                   "momentum, or a replica group other than the first)")
        b = t.detach().view(-1).view(torch.uint8)
        b[b.numel() // 2] ^= 0x10

    def _plan(self, m: int) -> list[list[int]]:
        """The step's microbatch ids per rank: the layout's plan, or with `--straggler
        rebalance` once a straggler was found, weighted by the ranks' speeds."""
        weights = self._stragglers.weights_for(self.generation)
        if weights is not None:
            return quota.plan_weighted(m, weights)
        return self.state.layout.work.plan(m, self.world_size)

    def _new_step(self, index: int, ids: list[int], m: int) -> Step:
        return Step(index, ids, m, on_backward=self._on_backward, on_clip=self._clip,
                    executor=self.state.layout.executor if self.state is not None else None,
                    on_check=lambda st: self._recompute.checked(st, self.state),
                    on_check_phase=lambda on: self._recompute.phase(self.state, on),
                    on_loss=self._recompute.loss)

    def _in_backward(self) -> None:
        """A sharded model's gradient reduce-scatter is about to be issued (phase=backward
        faults land here, inside the user's backward pass)."""
        if self._current is not None:
            self.member.injector.at_step(self.rank, self._current.index, "backward")

    def _in_p2p(self, phase: str) -> None:
        """A pipeline's send or recv is about to be issued (phase=forward: activations,
        phase=backward: gradients)."""
        if self._current is not None:
            self.member.injector.at_step(self.rank, self._current.index, phase)

    def _on_backward(self, st: Step) -> None:
        self.member.count_pass()
        self._recompute.backward(st, self.state)
        self.member.injector.at_microbatch(self.rank, st.index, len(st.done) - 1)

    def _reduce(self, st: Step) -> None:
        """The step's one all-reduce (gradients, audit, loss), checked and averaged; run
        by `_complete`, or earlier by `Step.clip_grad_norm_`."""
        if st.reduced:
            return
        state, ops = self.state, self.member.ops
        failed = state.layout.members.failure()  # latched inside the user's passes (FSDP2)
        if failed is not None:
            raise failed
        lay = ReduceLayout(state.layout.math.grad_numel(), st.m, self.world_size,
                           self._fingerprints.slots(state))
        g = state.grad[:lay.total]
        state.layout.math.write_grads(g[lay.grads])
        g[lay.grads.stop:].zero_()  # the audit mask, the tail, the times and stalls: below
        t = self._stragglers.compute_s(self.member.slowdown(st.index),
                                       state.layout.executor.blocked_s())
        if not state.layout.executor.user_loop and st.done:
            # a pipeline replica's share may differ from another's (an uneven plan): its
            # stages are compared per microbatch
            t /= len(st.done)
        stall = self._stragglers.stall_s
        if not state.layout.executor.user_loop and st.done:
            stall /= len(st.done)  # (in the unit of its time)
        g[lay.times.start + self.rank] = t
        g[lay.stalls.start + self.rank] = stall
        self._fingerprints.fill(st, state, g[lay.fingerprints].view(self.world_size, -1)[self.rank]
                                if lay.votes else None)
        if state.layout.work.contributes():  # (one rank of a tensor-parallel group counts)
            for j in st.done:
                g[lay.mask.start + j] = 1.0  # which microbatches this rank contributes (the audit)
            g[lay.loss] = st.loss_sum
            g[lay.count] = len(st.done)
        if self.rank == 0 and self.store.check([Keys.grow(self.generation)]):
            g[lay.grow] = 1.0
        self.member.injector.at_step(self.rank, st.index, "reduce")
        self.member.tell_passes()
        st.phase = StepPhase.REDUCE
        state.layout.math.reduce(st.m, f"cross-group gradient all-reduce (step {st.index})")
        ops.allreduce(g, f"gradient all-reduce (step {st.index})")
        counts = g[lay.mask].tolist()
        if int(g[lay.count]) != st.m or any(c != 1.0 for c in counts):
            raise RuntimeError(f"step {st.index}: microbatch contributions {counts} do not "
                               f"cover each of the {st.m} microbatches exactly once")
        self._recompute.verdict(st)
        self._flip(st, "grad", g[lay.grads])
        self._fingerprints.begin(st, state, g[lay.grads], lay.total, slots=g[lay.fingerprints])
        self._grow_requested = bool(g[lay.grow] > 0)
        work, world = state.layout.work, self.world_size
        swap = self._stragglers.observe(rank=self.rank, generation=self.generation,
                                        members=self.member.plan.members, step=st.index,
                                        times=g[lay.times].tolist(),
                                        stalls=g[lay.stalls].tolist(),
                                        classes=work.peer_classes(world),
                                        where=lambda r: work.where(r, world))
        if swap is not None:  # the leader holds the job at a committed step and swaps it
            kv.set_json(self.store, Keys.straggler(self.generation), swap.to_dict())
        st.loss = float(g[lay.loss]) / st.m
        g[lay.grads].div_(st.m)
        st.grads, st.audit, st.reduced = g[lay.grads], counts, True

    def _clip(self, st: Step, max_norm: float, norm_type: float) -> torch.Tensor:
        """`Step.clip_grad_norm_`: the global norm of the averaged gradient, computed and
        applied per parameter exactly as `torch.nn.utils.clip_grad_norm_` does (over every
        shard of a sharded model: `layout.math.clip`)."""
        if st.failure is not None:  # (a pipeline schedule that a failure cut short)
            return torch.tensor(float("nan"))
        if len(st.done) < len(st.ids):
            raise RuntimeError(f"step {st.index}: clip_grad_norm_ must come after every "
                               "microbatch's backward (it reduces the step's gradients)")
        if st.speculative is not None:
            # a spare computed this ahead and has no group yet: it joins when the loop body
            # returns, and the step comes back (kept, or afresh) for the reduce and clip
            return torch.tensor(float("nan"))
        try:
            self._reduce(st)
        except CommFailure as exc:  # recovered when the loop body returns; the step reruns
            st.failure = exc
            return torch.tensor(float("nan"))
        layout = self.state.layout
        self.member.injector.at_step(self.rank, st.index, "clip")
        norm = layout.math.clip(st.grads, max_norm, norm_type)
        failed = layout.members.failure()  # (a sharded layout's norm all-reduce, latched)
        if failed is not None:
            st.failure = failed
            return torch.tensor(float("nan"))
        return norm

    def _complete(self, st: Step) -> None:
        """All-reduce (unless clipping did it), update, all-gather, publish, snapshot."""
        if st.failure is not None:
            raise st.failure
        state, ops = self.state, self.member.ops
        self._reduce(st)
        st.phase = StepPhase.UPDATE
        self.member.injector.at_step(self.rank, st.index, "update")
        state.layout.math.update(st.grads, ops, f"parameter all-gather (step {st.index})",
                            before_gather=self._fingerprints.settle)
        self._flip(st, "param")
        state.zero_grad()
        state.step = st.index
        if self.rank == 0:
            # one round trip on the critical path, not three
            self.store.multi_set(
                [Keys.loss(state.step), Keys.audit(state.step), Keys.PROGRESS, Keys.VOUCHED],
                [repr(st.loss), json.dumps([j for j, c in enumerate(st.audit) if c > 0]),
                 str(state.step), str(self._fingerprints.vouched(state))])
            self.events.emit("step", step=state.step, loss=st.loss, gen=self.generation,
                             world_size=self.world_size,
                             compute_s=[round(t, 4) for t in self._stragglers.last_times],
                             **({"stall_s": [round(t, 4) for t in self._stragglers.last_stalls]}
                                if any(self._stragglers.last_stalls) else {}),
                             **self._fingerprints.costs(),
                             **({"check_s": round(self._recompute.check_s, 6)}
                                if self._recompute.check_s else {}))
        self.member.snapshot(state)
        self._flip(st, "optim")

    def _write_checkpoint(self, full: dict[str, torch.Tensor], persist_url: str) -> None:
        """The final state as a checkpoint in DCP's default format under the persist URL
        (`train/dcp_io.py`), from the tensors gathered for the digest. A failure is said
        (event, summary) and leaves the persisted records as they are."""
        from phoenixft.checkpoint.dcp_checkpoint import checkpoint_url, write
        from phoenixft.train.dcp_io import final_state

        url = checkpoint_url(persist_url, self.state.step)
        t0 = time.perf_counter()
        try:
            write(url, final_state(self.state.model, self.state.layout.math.optimizer, full,
                                   self.state.step))
        except Exception as exc:  # noqa: BLE001 - storage errors of every kind: said, not raised
            self.events.emit("checkpoint_failed", url=url, error=f"{type(exc).__name__}: {exc}"[:500])
            self.store.set(Keys.result("checkpoint_error"), f"{url}: {exc}"[:500])
            return
        self.events.emit("checkpoint", url=url, step=self.state.step,
                         seconds=round(time.perf_counter() - t0, 3))
        self.store.set(Keys.result("checkpoint"), url)

    def _finish(self) -> None:
        member = self.member
        member.snap.wait_copied()
        # the vote and the seal the next step would have run (a flip on the last step)
        self._fingerprints.final(self.state)
        if self.rank == 0:  # (the vote just vouched for the last step: its manifest may go)
            self.store.set(Keys.VOUCHED, str(self._fingerprints.vouched(self.state)))
        member.flush_persisted(self.state.step)
        self.events.emit("snapshot_stats", rank=self.rank, gen=self.generation,
                         **{k: round(v, 4) for k, v in member.snap.stats.items()})
        full = self.full_state()
        digest = state_digest(full)
        if self.rank == 0:  # before the barrier: no member leaves before the result exists
            if member.cfg.persistence.url:
                self._write_checkpoint(full, member.cfg.persistence.url)
            self.store.set(Keys.result("final_step"), str(self.state.step))
            self.store.set(Keys.result("digest"), digest)
            self.events.emit("done", step=self.state.step, digest=digest)
        member.ops.barrier("final barrier")
        self.store.set(Keys.finished(self.wid), str(self.state.step))
        self.final_digest = digest

