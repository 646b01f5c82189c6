"""`recovery.restore` deciding, per member, whether work done in the step in flight is kept:
a real one-rank gloo group, a real TCPStore and a real snapshot slot of the restore step.

The integration tests (test_hotswap, test_fault_matrix) show a spare's work computed
ahead being kept, against failure-free digests; the case where the members restore
another step than the one the spare computed from only happens in a race, so it is
driven here directly."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from phoenixft.checkpoint.restore import RestorePlanner
from phoenixft.checkpoint.snapshot import Snapshotter, mark_committed
from phoenixft.cluster import store as kv
from phoenixft.cluster.keys import Keys
from phoenixft.comm.collectives import GroupOps, Interrupt
from phoenixft.comm.groups import new_group
from phoenixft.observe.events import EventLog
from phoenixft.train import recovery
from phoenixft.train.layouts import LayoutArgs, build
from phoenixft.train.rank_state import RankState
from phoenixft.train.recovery import JoinContext, RestorePoint
from phoenixft.train.step import Step
from phoenixft.train.tracked import Tracked


@pytest.fixture()
def joined(tmp_path):
    """A rank-0 member of a one-rank generation 1 whose snapshot of step 3 (written by
    generation 0) is committed, with a step 4 in flight holding one finished microbatch."""
    server, port = kv.host_store("127.0.0.1")
    addr = f"127.0.0.1:{port}"
    store = kv.connect(addr)
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    layout = build(LayoutArgs(model=model, optimizer=lambda p: torch.optim.AdamW(p, lr=0.1)))
    layout.members.join(0, 1)
    state = RankState(model=model, layout=layout, tracked=Tracked(), m=1, initial_world=1)
    interrupt = Interrupt()
    interrupt.enter(0)
    snap = Snapshotter(shm_dir=tmp_path / "shm", rank=0, generation=0,
                       connect=lambda: kv.connect(addr), rep_pg=None, holders=[], sources=[],
                       world_size=1, nodes={0: 0}, interrupt=interrupt, timeout_s=30)
    mark_committed(store, 2, {"generation": 0, "world_size": 1})
    state.step = 3
    snap.begin(3, state.snapshot(rank=0, world_size=1))
    snap.wait_copied(committed=True)
    snap.stop()
    interrupt.enter(1)
    ops = GroupOps(new_group(kv.connect(addr), "g1/train/", 0, 1, device=torch.device("cpu")),
                   interrupt, 30)
    ctx = JoinContext(generation=1, rank=0, world_size=1, ops=ops, store=store,
                      planner=RestorePlanner.for_node(tmp_path / "shm"),
                      events=EventLog(None), make_step=lambda i, ids, m: Step(i, ids, m))
    step = Step(4, [0], 1)
    for _ in step.microbatches():
        step.backward(model(torch.ones(2, 4)).square().mean())
    yield ctx, state, step
    del server


def test_work_computed_ahead_from_the_restored_step_is_kept(joined):
    ctx, state, step = joined
    step.speculative = (3, 0)
    grad = state.model.weight.grad.clone()
    source, resumed = recovery.restore(ctx, state, RestorePoint(3, 1, 0), step, new_member=False)
    assert source == "local_snapshot" and resumed is step and step.speculative is None
    assert step.done == [0] and step.loss_sum > 0 and state.step == 3
    assert torch.equal(state.model.weight.grad, grad)


@pytest.mark.parametrize("ahead", [(2, 0), (3, 5)], ids=["other-step", "other-generation"])
def test_work_computed_ahead_from_another_step_is_dropped(joined, ahead):
    """The spare computed from step 2 (or from a step 3 another generation wrote) but the
    members restore generation 0's step 3: its gradients and finished ids are dropped, and
    with no one else keeping work the step starts afresh."""
    ctx, state, step = joined
    step.speculative = ahead
    source, resumed = recovery.restore(ctx, state, RestorePoint(3, 1, 0), step, new_member=False)
    assert resumed is None and step.speculative is None
    assert step.done == [] and step.loss_sum == 0.0
    assert state.model.weight.grad is None and state.step == 3


@pytest.mark.parametrize("ahead", [True, False], ids=["computed-ahead", "fresh"])
def test_members_that_all_computed_ahead_restore_the_uncommitted_step(joined, ahead):
    """No survivor is left (the last one died during a recovery) and step 3's snapshots
    are verified but were never committed: members that all computed ahead from step 3
    restore 3 (and keep that work); fresh members restore the committed step 2."""
    ctx, state, _ = joined
    ctx.store.set(Keys.COMMITTED, "2")  # the commit of 3 never happened
    state.snap_from = (0, 1) if ahead else (-1, -1)
    point = recovery.restore_point(ctx, state, new_member=True, ahead=ahead)
    assert point == (RestorePoint(3, 1, 0) if ahead else RestorePoint(2, 1, 0))
