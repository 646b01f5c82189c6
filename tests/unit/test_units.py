"""Fast in-process tests of the pieces under the hot-swap protocol."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from phoenixft import state_digest
from phoenixft.checkpoint.integrity import IntegrityError
from phoenixft.checkpoint.slots import HEADER_BYTES, Layout, SlotFile, slot_path
from phoenixft.cluster.membership import Plan, replica_holders
from phoenixft.faults.inject import Injector, InjectSpecError, parse_env, parse_spec
from phoenixft.observe.events import EventLog, read_events
from phoenixft.train.tracked import Tracked
from phoenixft.train.zero import FlatParams, ShardedOptimizer


def write_slot(path, step, tensors, meta=None) -> SlotFile:
    lay = Layout.of(tensors)
    f = SlotFile(path)
    f.ensure(HEADER_BYTES + lay.data_nbytes)
    f.begin_write(step)
    for e in lay.entries:
        f.view(e).copy_(tensors[e.name])
    f.finish_write(step, lay, {"meta": meta or {}})
    return f


def test_slot_roundtrip_and_every_kind_of_damage(tmp_path):
    ts = {"a": torch.randn(100), "b": torch.arange(6, dtype=torch.int64).view(2, 3),
          "s": torch.tensor(3.5)}
    path = slot_path(tmp_path, "snap", 3, 7)
    write_slot(path, 7, ts, {"x": 1})
    f = SlotFile(path)
    hdr = f.verify(7)
    got = f.tensors(hdr)
    assert all(torch.equal(got[k], ts[k]) for k in ts) and hdr["meta"] == {"x": 1}
    with pytest.raises(IntegrityError, match="holds step 7, wanted step 5"):
        f.verify(5)
    f.np[HEADER_BYTES + 5] ^= 0xFF  # a flipped byte in the data
    with pytest.raises(IntegrityError, match="checksum mismatch"):
        f.verify(7)
    f.np[HEADER_BYTES + 5] ^= 0xFF
    f.begin_write(9)  # a writer that died mid-copy leaves the slot marked incomplete
    with pytest.raises(IntegrityError, match="incomplete"):
        SlotFile(path).verify(9)


def test_slot_truncated_file_is_rejected(tmp_path):
    path = slot_path(tmp_path, "snap", 0, 2)
    write_slot(path, 2, {"a": torch.randn(1000)})
    data = path.read_bytes()
    path.write_bytes(data[:HEADER_BYTES + 100])
    with pytest.raises(IntegrityError):
        SlotFile(path).verify(2)


def test_inject_specs():
    s = parse_spec("kill:rank=2:step=7")
    assert (s.kind, s.rank, s.step) == ("kill", 2, 7) and str(s) == "kill:rank=2:step=7"
    assert parse_spec("stop:rank=0:gen=1").gen == 1
    assert parse_spec("kill:rank=1:step=3:microbatch=2").microbatch == 2
    assert len(parse_env("kill:rank=1:step=3;stop:rank=0:step=4")) == 2
    for bad, msg in [("boom:rank=1:step=1", "unknown fault kind"), ("kill:rank=1", "exactly one"),
                     ("kill:rank=1:step=1:gen=1", "exactly one"), ("kill:rank=-1:step=1", ">= 0"),
                     ("kill:rank=1:gen=1:microbatch=0", "needs step"), ("kill:rank=1:foo=1", "bad field")]:
        with pytest.raises(InjectSpecError, match=msg):
            parse_spec(bad)


def test_injector_fires_once_per_spec(monkeypatch):
    fired, claimed = [], set()

    def claim(key):
        if key in claimed:
            return False
        claimed.add(key)
        return True

    monkeypatch.setattr("os.kill", lambda pid, sig: fired.append(sig))
    inj = Injector(parse_env("kill:rank=1:step=3;stop:rank=0:gen=2"), claim)
    inj.at_step(0, 3)
    inj.at_step(1, 2)
    assert fired == []
    inj.at_step(1, 3)
    inj.at_step(1, 3)  # the spare replaying step 3 is not killed again
    inj.at_recovery(0, 2)
    assert len(fired) == 2


def test_replica_holders_prefer_other_nodes():
    assert replica_holders({0: 0, 1: 0, 2: 0}, 1) == {0: [1], 1: [2], 2: [0]}
    h = replica_holders({0: 0, 1: 0, 2: 1, 3: 1}, 1)
    assert all({0: 0, 1: 0, 2: 1, 3: 1}[r] != {0: 0, 1: 0, 2: 1, 3: 1}[hs[0]] for r, hs in h.items())
    assert replica_holders({0: 0}, 0) == {0: []}


def test_plan_roundtrip():
    p = Plan(generation=3, members={0: "n0w0", 1: "n1w2"}, nodes={0: 0, 1: 1}, replaced={1: "n1w0"})
    q = Plan.from_json(p.to_json())
    assert q == p and q.rank_of("n1w2") == 1 and q.world_size == 2


def test_state_digest_is_canonical_and_sensitive():
    a = {"w": torch.ones(3), "opt": {"step": torch.tensor(2.0)}}
    b = {"opt": {"step": torch.tensor(2.0)}, "w": torch.ones(3)}
    assert state_digest(a) == state_digest(b)
    c = {"w": torch.ones(3), "opt": {"step": torch.tensor(2.0)}}
    c["w"][1] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
    assert state_digest(a) != state_digest(c)
    assert state_digest({"w": torch.ones(3)}) != state_digest({"w": torch.ones(3, dtype=torch.float64)})


@pytest.mark.parametrize("world", [1, 3])
def test_sharded_optimizer_matches_plain_adamw(world):
    """The shards of `world` ranks, stepped separately and gathered, equal one AdamW."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))
    plain = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    models = [torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3)) for _ in range(world)]
    for m in models:
        m.load_state_dict(ref.state_dict())
    flats = [FlatParams(m) for m in models]
    for f in flats:
        f.layout(world)
    opts = [ShardedOptimizer(f, lambda p: torch.optim.AdamW(p, lr=1e-2), r) for r, f in enumerate(flats)]
    for _ in range(3):
        x = torch.randn(4, 5)
        plain.zero_grad()
        ref(x).pow(2).sum().backward()
        plain.step()
        grads = []
        for m, f in zip(models, flats):
            m.zero_grad()
            m(x).pow(2).sum().backward()
            g = torch.zeros(f.buf.numel())
            f.gather_grads(g)
            grads.append(g)
        for o, g in zip(opts, grads):
            o.step(g)
        full = torch.cat([o.shard.detach() for o in opts])
        for f in flats:
            f.buf.copy_(full)
    for p, q in zip(ref.parameters(), models[0].parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


def test_sharded_optimizer_state_roundtrip():
    m = torch.nn.Linear(4, 4)
    f = FlatParams(m)
    f.layout(1)
    o = ShardedOptimizer(f, lambda p: torch.optim.AdamW(p, lr=1e-2), 0)
    m(torch.ones(2, 4)).sum().backward()
    g = torch.zeros(f.buf.numel())
    f.gather_grads(g)
    o.step(g)
    tensors = {k: v.clone() for k, v in o.state_tensors().items()}
    meta = json.loads(json.dumps(o.state_meta()))
    o.step(g)
    o.load_state(tensors, meta)
    assert torch.equal(o.shard, tensors["param_shard"])
    assert torch.equal(o.inner.state[o.shard]["exp_avg"], tensors["opt.exp_avg"])


def test_tracked_generator_and_stateful():
    class Pos:
        def __init__(self):
            self.i, self.t = 0, torch.zeros(2)

        def state_dict(self):
            return {"i": self.i, "t": self.t}

        def load_state_dict(self, s):
            self.i, self.t = s["i"], s["t"]

    g, p = torch.Generator().manual_seed(1), Pos()
    tr = Tracked()
    tr.add("gen", g)
    tr.add("pos", p)
    tensors, meta = tr.tensors(), json.loads(json.dumps(tr.meta()))
    first = torch.rand(3, generator=g)
    p.i, p.t = 5, torch.ones(2)
    tr.load(tensors, meta)
    assert torch.equal(torch.rand(3, generator=g), first) and p.i == 0 and not p.t.any()
    with pytest.raises(TypeError, match="cannot track"):
        tr.add("bad", object())


def test_event_log_lines_from_many_threads(tmp_path):
    log = EventLog(tmp_path / "events.jsonl", who="t")
    threads = [threading.Thread(target=lambda i=i: [log.emit("x", i=i, j=j) for j in range(200)])
               for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with open(tmp_path / "events.jsonl", "a") as f:
        f.write('{"torn": ')  # a writer killed mid-line
    events = list(read_events(tmp_path / "events.jsonl"))
    assert len(events) == 800 and all(e["who"] == "t" for e in events)


def test_quota_plans():
    from phoenixft.train.quota import effective_m, plan, reassign
    assert plan(8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert plan(8, 3) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert sorted(j for ids in plan(7, 5) for j in ids) == list(range(7))
    # a spare keeps its rank's ids; a shrink deals the orphans to the least loaded
    assert reassign([4, 5], plan(8, 4), 4) == [[], [], [4, 5], []]
    assert reassign([6, 7], plan(8, 4), 3) == [[6], [7], []]
    assert effective_m(8, 4, 3, "constant") == 8 and effective_m(8, 4, 3, "shrink-batch") == 6
    with pytest.raises(ValueError):
        effective_m(8, 4, 3, "bogus")


def test_heartbeat_monitor_does_not_count_its_own_stall(monkeypatch):
    import time as _time

    from phoenixft.cluster.heartbeat import HeartbeatMonitor
    from phoenixft.cluster.keys import Keys

    store = torch.distributed.HashStore()
    clock = [100.0]
    monkeypatch.setattr(_time, "monotonic", lambda: clock[0])
    mon = HeartbeatMonitor(store, stall_s=1.0)
    store.add(Keys.heartbeat("a"), 1)
    store.add(Keys.heartbeat("b"), 1)
    mon.watch("a")
    mon.watch("b")
    mon.poll()
    clock[0] += 0.5
    store.add(Keys.heartbeat("a"), 1)  # a beats, b goes quiet
    mon.poll()
    clock[0] += 0.5
    mon.poll()
    clock[0] += 10.0  # the monitor itself was starved for 10 s
    mon.poll()
    assert mon.stale(3.0) == []
    for _ in range(8):  # then b stays silent while the monitor runs normally
        clock[0] += 0.5
        store.add(Keys.heartbeat("a"), 1)
        mon.poll()
    assert mon.stale(3.0) == ["b"]
