"""The training session: the one place that knows the user's model and optimizer.

    sess = phoenixft.Session()                       # reads what `phoenixft run` set
    model = build_model()
    sess.setup(model, lambda p: torch.optim.AdamW(p, lr=3e-4), track={"data": sampler})
    for step in sess.steps(1000):                    # spares wait in setup() until needed
        for mb in step.microbatches():
            x, y = sampler.batch()
            step.backward(F.cross_entropy(model(x).flatten(0, 1), y.flatten()))

The session owns gradient reduction (one all-reduce of a flat buffer with a deadline),
the ZeRO-1 optimizer step, per-step snapshots and their replicas, and recovery: when a
collective fails or the leader publishes a new generation, it stops the snapshot thread,
joins the new generation's groups, restores every rank to the newest committed snapshot
and resumes the loop there. Survivors are never restarted.
"""

from __future__ import annotations

import atexit
import json
import os
import random
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import torch
from torch import nn

from phoenixft.checkpoint.snapshot import Snapshotter
from phoenixft.cluster import store as kv
from phoenixft.cluster.heartbeat import HeartbeatSender
from phoenixft.cluster.membership import Plan, replica_holders
from phoenixft.cluster.store import Keys
from phoenixft.comm.collectives import (
    CommFailure,
    GenerationChanged,
    Interrupt,
    call_with_deadline,
    wait_work,
)
from phoenixft.comm.groups import abort_group, new_group
from phoenixft.launch.inject import Injector, parse_env
from phoenixft.observe.events import EventLog
from phoenixft.train import quota, rejoin
from phoenixft.train.config import SessionConfig
from phoenixft.train.digest import state_digest
from phoenixft.train.step import Step
from phoenixft.train.tracked import Tracked
from phoenixft.train.zero import FlatParams, ShardedOptimizer


class JobAborted(SystemExit):
    """The leader stopped the job (no spare left, a script error elsewhere)."""


class Session:
    def __init__(self, config: SessionConfig | None = None) -> None:
        self.cfg = config or SessionConfig.from_env()
        self.wid = self.cfg.worker_id
        self._own_store = None
        if self.cfg.store is None:  # standalone: host a private store, lead ourselves
            port = kv.free_port()
            self._own_store = kv.host_store("127.0.0.1", port)
            self.cfg.store = f"127.0.0.1:{port}"
        self.store = kv.connect(self.cfg.store)
        self.events = EventLog(Path(self.cfg.run_dir) / "events.jsonl" if self.cfg.run_dir else None,
                               wid=self.wid)
        self.interrupt = Interrupt()
        self._injector = Injector(parse_env(self.cfg.inject), self._claim_injection,
                                  self._on_injection)
        self.rank = -1
        self.world_size = 0
        self.generation = -1
        self.step = 0
        self.plan: Plan | None = None
        self.tracked = Tracked()
        self._pg = None
        self._rep_pg = None
        self._dead_groups: list = []
        self._pending: Step | None = None
        self._grow_requested = False
        self._snap_from = (-1, -1)
        self.m = 0  # microbatches per step (set in setup)
        self.initial_world = 0
        self._snap: Snapshotter | None = None
        self._flat: FlatParams | None = None
        self._opt: ShardedOptimizer | None = None
        self._factory = None
        self._model: nn.Module | None = None
        self._grad: torch.Tensor | None = None
        self._heartbeat = HeartbeatSender(self._connect, self.wid,
                                          self.cfg.heartbeat_interval_s).start()
        self._exit_code = 0
        self._install_exit_hooks()
        kv.set_json(self.store, Keys.worker(self.wid),
                    {"pid": os.getpid(), "node": self.cfg.node})
        self.store.add(Keys.REGISTERED, 1)
        if self._own_store is not None:
            plan = Plan(generation=0, members={0: self.wid}, nodes={0: self.cfg.node})
            self.store.set(Keys.plan(0), plan.to_json())

    # -- public API -----------------------------------------------------------------
    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer running on this rank's shard (for LR schedulers)."""
        if self._opt is None:
            raise RuntimeError("call Session.setup() first")
        return self._opt.inner

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def setup(self, model: nn.Module,
              optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
              *, track: dict[str, object] | None = None, microbatches: int | None = None) -> None:
        """Register the model, the optimizer factory and any extra per-rank state
        (data samplers, generators, LR schedulers). `microbatches` is M, the microbatches
        of every step (default: the starting world size, one per rank). Spares block here
        until activated."""
        if microbatches is not None and microbatches < 1:
            raise ValueError(f"microbatches must be >= 1, got {microbatches}")
        self._m_requested = microbatches
        self._model = model
        self._factory = optimizer
        for name, obj in (track or {}).items():
            self.tracked.add(name, obj)
        self._flat = FlatParams(model)
        self._warm_up()
        plan = self._await_plan(0, self.cfg.spare_wait_s)
        first = Plan.from_json(self.store.get(Keys.plan(0)))
        self.initial_world = first.world_size or 1
        self.m = self._m_requested or self.initial_world
        self._enter(plan)

    def _warm_up(self) -> None:
        """Pay lazy imports and first-call costs now, not on activation: constructing and
        stepping a torch optimizer the first time imports torch._dynamo (~2 s here)."""
        p = nn.Parameter(torch.zeros(8, dtype=self._flat.dtype, device=self._flat.device))
        opt = self._factory([p])
        p.grad = torch.zeros_like(p)
        opt.step()
        state_digest({"warm": p.detach()})

    def steps(self, total: int) -> Iterator[Step]:
        """Yield steps until `total` optimizer steps are done, recovering from failures."""
        if self._opt is None:
            raise RuntimeError("call Session.setup() before Session.steps()")
        while True:
            if self.step >= total:
                try:
                    self._finish(total)
                    return
                except CommFailure as exc:
                    self._recover(exc, None)
                    continue
            st, self._pending = self._pending, None
            if st is None:
                m = self._m_for(self.world_size)
                st = Step(self, self.step + 1, quota.plan(m, self.world_size)[self.rank], m)
                self._injector.at_step(self.rank, st.index)
            yield st
            try:
                self._complete(st)
            except CommFailure as exc:
                self._recover(exc, st)
                continue
            if self._grow_requested:
                self._hand_over_for_growth()

    def full_state(self) -> dict[str, torch.Tensor]:
        """Collective: the whole model and (unsharded) optimizer state, world-size free."""
        flat, opt = self._flat, self._opt
        out = {f"model.{k}": v for k, v in flat.unflatten(flat.buf).items()}
        for name, t in opt.state_tensors().items():
            if not name.startswith("opt."):
                continue
            if t.dim() == 0:
                out[f"optim.{name[4:]}"] = t
                continue
            full = torch.empty(t.numel() * self.world_size, dtype=t.dtype, device=t.device)
            wait_work(self._pg._allgather_base(full, t.contiguous()), self.interrupt,
                      self.cfg.collective_timeout_s, "state gather")
            for k, v in flat.unflatten(full).items():
                out[f"optim.{name[4:]}.{k}"] = v
        return out

    def log(self, event: str, **fields) -> None:
        self.events.emit(event, rank=self.rank, gen=self.generation, **fields)

    # -- the step -------------------------------------------------------------------
    def _m_for(self, world_size: int) -> int:
        return quota.effective_m(self.m, self.initial_world, world_size, self.cfg.policy)

    def _complete(self, st: Step) -> None:
        flat, n, size = self._flat, self._flat.numel, self._flat.buf.numel()
        g = self._grad[:size + st.m + 3]
        flat.gather_grads(g)
        g[n:].zero_()
        for j in st.done:
            g[size + j] = 1.0  # which microbatches this rank contributes (the audit)
        if self.rank == 0 and self.store.check([Keys.grow(self.generation)]):
            g[-3] = 1.0
        g[-2] = st.loss_sum
        g[-1] = len(st.done)
        st.phase = "reduce"
        wait_work(self._pg.allreduce([g]), self.interrupt, self.cfg.collective_timeout_s,
                  f"gradient all-reduce (step {st.index})")
        st.phase = "update"
        counts = g[size:size + st.m].tolist()
        if int(g[-1]) != st.m or any(c != 1.0 for c in counts):
            raise RuntimeError(f"step {st.index}: microbatch contributions {counts} do not "
                               f"cover each of the {st.m} microbatches exactly once")
        self._grow_requested = g[-3] > 0
        loss = float(g[-2]) / st.m
        g[:size].div_(st.m)
        self._opt.step(g[:size])  # its pre-hook waits for the previous snapshot copy
        wait_work(self._pg._allgather_base(flat.buf, self._opt.shard.detach()),
                  self.interrupt, self.cfg.collective_timeout_s,
                  f"parameter all-gather (step {st.index})")
        self._model.zero_grad(set_to_none=True)
        self.step = st.index
        if self.rank == 0:
            # one round trip on the critical path, not three
            self.store.multi_set(
                [Keys.loss(self.step), Keys.audit(self.step), Keys.PROGRESS],
                [repr(loss), json.dumps([j for j, c in enumerate(counts) if c > 0]),
                 str(self.step)])
            self.events.emit("step", step=self.step, loss=loss, gen=self.generation,
                             world_size=self.world_size)
        self._snapshot()

    def _snapshot(self) -> None:
        if not self.cfg.snapshots:
            return
        tensors = self._opt.state_tensors()
        tensors["rng.torch"] = torch.get_rng_state()
        if torch.cuda.is_available() and self._flat.device.type == "cuda":
            tensors["rng.cuda"] = torch.cuda.get_rng_state(self._flat.device)
        tensors.update(self.tracked.tensors())
        header = {"rank": self.rank, "world_size": self.world_size, "numel": self._flat.numel,
                  "opt": self._opt.state_meta(), "tracked": self.tracked.meta(),
                  "python_random": random.getstate()}
        if self.step == 1 and self.rank == 0:
            nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
            copies = 1 + len(replica_holders(self.plan.nodes, 1)[0]) if self.world_size > 1 else 1
            self.events.emit("snapshot_size", bytes_per_slot=nbytes, slots=2, copies=copies,
                             host_bytes_per_rank=2 * copies * nbytes)
        self._snap_from = (self.generation, self.world_size)  # who wrote snapshot self.step
        self._snap.begin(self.step, tensors, header)

    def _finish(self, total: int) -> None:
        self._snap.wait_copied()
        self.events.emit("snapshot_stats", rank=self.rank, gen=self.generation,
                         **{k: round(v, 4) for k, v in self._snap.stats.items()})
        digest = state_digest(self.full_state())
        wait_work(self._pg.allreduce([torch.zeros(1)]), self.interrupt,
                  self.cfg.collective_timeout_s, "final barrier")
        if self.rank == 0:
            self.store.set(Keys.result("final_step"), str(self.step))
            self.store.set(Keys.result("digest"), digest)
            self.events.emit("done", step=self.step, digest=digest)
        self.final_digest = digest

    # -- generations ----------------------------------------------------------------
    def _await_plan(self, g: int, timeout_s: float) -> Plan:
        """The newest plan at generation >= g, waiting up to timeout_s for the first."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                left = max(0.1, deadline - time.monotonic())
                self.store.wait([Keys.plan(g)], timedelta(seconds=left))
                break
            except Exception:
                if time.monotonic() > deadline:
                    self._exit_code = 1
                    raise JobAborted(f"phoenixft: no generation {g} plan within {timeout_s:.0f}s; "
                                     "is the agent alive?") from None
        while self.store.check([Keys.plan(g + 1)]):
            g += 1
        return Plan.from_json(self.store.get(Keys.plan(g)))

    def _enter(self, plan: Plan, in_flight: Step | None = None) -> None:
        """Wait as a spare until a plan includes us, then join it (retrying newer ones)."""
        while True:
            if plan.kind in ("done", "abort"):
                self._leave(plan)
            if plan.rank_of(self.wid) is None:
                plan = self._await_plan(plan.generation + 1, self.cfg.spare_wait_s)
                continue
            try:
                self._join(plan, in_flight)
                return
            except CommFailure as exc:
                self.events.emit("join_failed", gen=plan.generation, error=str(exc))
                self._dead_groups += [self._pg, self._rep_pg]
                self._pg = self._rep_pg = None
                plan = self._await_plan(plan.generation + 1, self.cfg.join_timeout_s)

    def _leave(self, plan: Plan) -> None:
        self._shutdown()
        if plan.kind == "abort":
            self._exit_code = 1
            raise JobAborted(f"phoenixft: job stopped by the leader: {plan.reason}")
        raise SystemExit(0)

    def _watch(self, g_next: int) -> None:
        store = self._connect()
        while self.generation < g_next:
            try:
                store.wait([Keys.plan(g_next)], timedelta(hours=24))
                self.interrupt.announce(g_next)
                return
            except Exception:
                continue

    def _join(self, plan: Plan, in_flight: Step | None = None) -> None:
        t0 = time.time()
        g = plan.generation
        first = self._opt is None
        self.plan, self.generation = plan, g
        self.interrupt.enter(g)
        threading.Thread(target=self._watch, args=(g + 1,), daemon=True,
                         name=f"phoenixft-watch-{g + 1}").start()
        self.rank, self.world_size = plan.rank_of(self.wid), plan.world_size
        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world_size))
        if g > 0:
            self._injector.at_recovery(self.rank, g)
        dev = self._flat.device
        host = kv.parse_addr(self.cfg.store)[0]
        # Each build gets its own store connection: an abandoned build (a member died
        # mid-join) keeps blocking in a store wait, and a shared client would queue
        # every later call behind it.
        self._pg = call_with_deadline(
            lambda: new_group(self._connect(), f"gen/{g}/train/", self.rank, self.world_size,
                              device=dev, bind_host=host, timeout_s=self.cfg.collective_timeout_s),
            self.interrupt, self.cfg.join_timeout_s, f"building generation {g}'s group")
        phases = {"group": time.time() - t0}
        self._rep_pg = call_with_deadline(
            lambda: new_group(self._connect(), f"gen/{g}/replicate/", self.rank, self.world_size,
                              device=torch.device("cpu"), bind_host=host,
                              timeout_s=self.cfg.collective_timeout_s),
            self.interrupt, self.cfg.join_timeout_s, f"building generation {g}'s replica group")
        self._flat.layout(self.world_size)
        if first or self._opt.rank != self.rank or self._opt.world_size != self.world_size:
            self._opt = ShardedOptimizer(self._flat, self._factory, self.rank)
            self._opt.inner.register_step_pre_hook(lambda *_: self._snap.wait_copied())
        self._grad = torch.zeros(self._flat.buf.numel() + max(self.m, self._m_for(self.world_size)) + 3,
                                 dtype=self._flat.dtype, device=dev)
        phases["rep_group"] = time.time() - t0
        restore_step, old_world, old_gen = rejoin.restore_point(self, new_member=first)
        source = "init"
        self._pending = None
        if restore_step < 0:  # fresh start: everyone takes rank 0's initial parameters
            self._model.zero_grad(set_to_none=True)
            wait_work(self._pg.broadcast(self._flat.buf, 0), self.interrupt,
                      self.cfg.collective_timeout_s, "initial parameter broadcast")
            self._opt.reload_shard_from_params()
            self.step = 0
        else:
            source, self._pending = rejoin.restore(self, restore_step, in_flight, new_member=first,
                                                   old_world=old_world, old_gen=old_gen)
        phases["restore"] = time.time() - t0
        holders = replica_holders(plan.nodes, min(self.cfg.replicas, self.world_size - 1))
        self._snap = Snapshotter(
            shm_dir=self.cfg.shm_dir, rank=self.rank, generation=g, connect=self._connect,
            rep_pg=self._rep_pg, holders=holders[self.rank],
            sources=[r for r, hs in holders.items() if self.rank in hs],
            world_size=self.world_size, nodes=plan.nodes, interrupt=self.interrupt,
            timeout_s=self.cfg.collective_timeout_s, on_commit=self._on_commit)
        if restore_step < 0:
            self._snapshot()
        wait_work(self._pg.allreduce([torch.zeros(1)]), self.interrupt,
                  self.cfg.collective_timeout_s, "generation barrier")
        now = time.time()
        if g > 0:
            self.store.set(f"source/{g}/{self.rank}", source)
        if g > 0 and self.rank == 0:
            rec = dict(gen=g, step=self.step, restore_step=restore_step,
                       replaced=plan.replaced, join_s=round(now - t0, 4),
                       lost_steps=max(0, plan.progress - max(restore_step, 0)),
                       in_step=self._pending is not None, world_size=self.world_size,
                       detect_s=_delta(plan.t_fail, plan.t_detect),
                       recover_s=_delta(plan.t_detect, now))
            kv.set_json(self.store, f"recovered/{g}", rec)
            self.events.emit("recovered", **rec)
        phases["barrier"] = time.time() - t0
        self.events.emit("joined", gen=g, rank=self.rank, world_size=self.world_size,
                         step=self.step, source=source, pid=os.getpid(),
                         phases={k: round(v, 4) for k, v in phases.items()})

    def _recover(self, exc: CommFailure, in_flight: Step | None) -> None:
        if not isinstance(exc, GenerationChanged):
            self._report("collective", str(exc))
        self.events.emit("failure_seen", gen=self.generation, rank=self.rank, step=self.step,
                         error=str(exc)[:300])
        if self._snap is not None:
            self._snap.stop()
        abort_group(self._pg)
        abort_group(self._rep_pg)
        # A broken gloo group's destructor joins its worker threads, which sit in the
        # abandoned collective until gloo's own timeout: dropping the last reference here
        # would stall recovery for that long. Keep dead groups referenced instead.
        self._dead_groups += [self._pg, self._rep_pg]
        self._pg = self._rep_pg = None
        # ...and never let their late-finishing ops write into live buffers.
        self._flat.relocate()
        self._enter(self._await_plan(self.generation + 1, self.cfg.join_timeout_s), in_flight)

    def _hand_over_for_growth(self) -> None:
        """The leader asked to admit new members: finish here, at a committed step
        boundary, and join the grown generation (nothing is recomputed)."""
        self._grow_requested = False
        if self.cfg.snapshots:
            self._snap.wait_committed(self.step, self.store)
        if self.rank == 0:
            self.store.set(Keys.grow_ready(self.generation), str(self.step))
        self._recover(GenerationChanged("admitting new members"), None)

    # -- plumbing -------------------------------------------------------------------
    def _connect(self):
        return kv.connect(self.cfg.store)

    def _on_commit(self, step: int, t: float) -> None:
        if step % 10 == 0:
            self.events.emit("snapshot_committed", step=step, gen=self.generation)

    def _report(self, kind: str, detail: str) -> None:
        try:
            i = self.store.add(Keys.REPORTS, 1)
            kv.set_json(self.store, Keys.report(i), {"kind": kind, "wid": self.wid,
                                                      "gen": self.generation, "t": time.time(),
                                                      "detail": detail[:500]})
        except Exception:
            pass

    def _claim_injection(self, spec: str) -> bool:
        return self.store.add(Keys.inject(spec), 1) == 1

    def _on_injection(self, spec, t: float, point: dict) -> None:
        self.store.set(f"failing/{self.wid}", repr(t))
        fields = {"rank": self.rank, "gen": self.generation, "pid": os.getpid(),
                  "world_size": self.world_size, **point}
        self.events.emit("inject", spec=str(spec), **fields)

    def _install_exit_hooks(self) -> None:
        previous = sys.excepthook

        def hook(tp, value, tb):
            self._exit_code = 1
            if not issubclass(tp, (KeyboardInterrupt, JobAborted)):
                text = "".join(traceback.format_exception(tp, value, tb))
                try:
                    self.store.set(Keys.error(self.wid), text[-4000:])
                except Exception:
                    pass
            previous(tp, value, tb)

        sys.excepthook = hook
        atexit.register(self._at_exit)

    def _at_exit(self) -> None:
        """Mark a clean exit, then leave without interpreter teardown: our daemon threads
        may sit in C++ (a store wait, an abandoned gloo wait), and tearing the runtime
        down under them aborts the process (std::terminate)."""
        try:
            if self._exit_code == 0:
                self.store.set(Keys.exit(self.wid), "done")
        except Exception:
            pass
        self._shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(self._exit_code)

    def _shutdown(self) -> None:
        self._heartbeat.stop()
        if self._snap is not None:
            self._snap.stop(join_timeout_s=2.0)


def _delta(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(b - a, 4)
