"""What real training loops use, in a standalone (one-process) session, each against the
same loop written with torch alone: clipping, mixed precision with fp32 master weights, an
LR scheduler, saving and loading weights."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

import phoenixft
from phoenixft.train.zero import FlatParams, ShardedOptimizer

pytestmark = pytest.mark.timeout(120)


def _model(dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(dtype)


def _data(dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(32, 8, generator=g).to(dtype), torch.randn(32, 4, generator=g).to(dtype))
            for _ in range(5)]


@pytest.fixture()
def session():
    made = []

    def make():
        s = phoenixft.Session()
        made.append(s)
        return s
    yield make
    for s in made:
        s.close()


def test_clip_grad_norm_and_scheduler_match_torch(session):
    data = _data()
    ref = _model()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    ref_norms = []
    for x, y in data:
        opt.zero_grad()
        ((ref(x) - y) ** 2).mean().backward()
        ref_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.3))
        opt.step()
        sched.step()

    model = _model()
    sess = session()
    sess.setup(model, lambda p: torch.optim.AdamW(p, lr=1e-2),
               scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 2, 0.5))
    norms = []
    for st in sess.steps(len(data)):
        for _ in st.microbatches():
            x, y = data[st.index - 1]
            st.backward(((model(x) - y) ** 2).mean())
        norms.append(st.clip_grad_norm_(0.3))
    assert torch.equal(torch.stack(norms), torch.stack(ref_norms))
    assert all(n > 0.3 for n in ref_norms[:2])  # clipping did bite
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)
    assert sess.scheduler.get_last_lr() == sched.get_last_lr()


def test_clip_before_the_last_backward_is_refused(session):
    model = _model()
    sess = session()
    sess.setup(model, lambda p: torch.optim.SGD(p, lr=0.1), microbatches=2)
    x, y = _data()[0]
    with pytest.raises(RuntimeError, match="after every microbatch's backward"):
        for st in sess.steps(1):
            for _ in st.microbatches():
                st.backward(((model(x) - y) ** 2).mean())
                st.clip_grad_norm_(1.0)


def test_bf16_parameters_train_on_fp32_master_weights(session):
    data = _data(torch.bfloat16)
    # the reference: an fp32 master copy, AdamW on it, rounded to bf16 after each step
    ref = _model(torch.bfloat16)
    master = [p.detach().float().requires_grad_() for p in ref.parameters()]
    opt = torch.optim.AdamW(master, lr=1e-2)
    for x, y in data:
        ref.zero_grad()
        ((ref(x) - y) ** 2).float().mean().backward()
        for m, p in zip(master, ref.parameters()):
            m.grad = p.grad.float()
        opt.step()
        with torch.no_grad():
            for m, p in zip(master, ref.parameters()):
                p.copy_(m)

    model = _model(torch.bfloat16)
    sess = session()
    sess.setup(model, lambda p: torch.optim.AdamW(p, lr=1e-2))
    for st in sess.steps(len(data)):
        for _ in st.microbatches():
            x, y = data[st.index - 1]
            st.backward(((model(x) - y) ** 2).float().mean())
    shard = sess.state.layout.math.opt.shard
    assert shard.dtype == torch.float32
    assert {v.dtype for v in sess.optimizer.state[shard].values() if v.dim()} == {torch.float32}
    for a, b in zip(model.parameters(), ref.parameters()):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b)
    flat_master = torch.cat([m.detach().reshape(-1) for m in master])
    assert torch.equal(shard.detach()[:flat_master.numel()], flat_master)


def test_the_scheduler_travels_with_the_optimizer_state():
    model = _model()
    flat = FlatParams(model)
    flat.layout(1)

    def make():
        return ShardedOptimizer(flat, lambda p: torch.optim.SGD(p, lr=1.0),
                                0, lambda o: torch.optim.lr_scheduler.LinearLR(o, 0.1, 1.0, 10))
    a = make()
    for _ in range(3):
        a.step(torch.zeros(flat.buf.numel()))
    b = make()
    b.load_state(a.state_tensors(), copy.deepcopy(a.state_meta()))
    assert b.sched.state_dict() == a.sched.state_dict()
    assert b.inner.param_groups[0]["lr"] == a.inner.param_groups[0]["lr"] != 0.1
    b.step(torch.zeros(flat.buf.numel()))
    a.step(torch.zeros(flat.buf.numel()))
    assert b.inner.param_groups[0]["lr"] == a.inner.param_groups[0]["lr"]


def test_a_scheduler_that_cannot_be_snapshotted_is_refused():
    model = _model()
    flat = FlatParams(model)
    flat.layout(1)

    class Odd(torch.optim.lr_scheduler.StepLR):
        def state_dict(self):
            return {"f": object()}
    with pytest.raises(TypeError, match="JSON-serialisable"):
        ShardedOptimizer(flat, lambda p: torch.optim.SGD(p, lr=1.0), 0, lambda o: Odd(o, 2))


def test_save_pretrained_then_load_state(session, tmp_path):
    from phoenixft.models.llama import LlamaForCausalLM, preset
    torch.manual_seed(0)
    model = LlamaForCausalLM(preset("tiny"))
    sess = session()
    sess.setup(model, lambda p: torch.optim.SGD(p, lr=0.1))
    out = sess.save_pretrained(tmp_path / "m")
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()

    torch.manual_seed(1)
    other = LlamaForCausalLM(preset("tiny"))
    sess2 = session()
    sess2.load_state((other, out))  # before setup
    for (n, a), (_, b) in zip(model.state_dict().items(), other.state_dict().items()):
        assert torch.equal(a, b), n
    with pytest.raises(ValueError, match="missing"):
        sess2.load_state((nn.Linear(2, 2), out))
    with pytest.raises(ValueError, match="only .safetensors"):
        (tmp_path / "w.pt").write_bytes(b"x")
        sess2.load_state((other, tmp_path / "w.pt"))


def test_a_standalone_session_keeps_stderr_clean(tmp_path):
    """A notebook or `python train.py` has no `phoenixft run` to quiet torch's C++ logger:
    a store wait that times out by design (a thread watching for a new generation that no
    leader will publish) printed two c10d warnings every 250 ms. A second of training with
    snapshots and persistence must print nothing."""
    import subprocess
    import sys
    import textwrap
    script = textwrap.dedent(f"""
        import threading, time, torch, phoenixft
        from phoenixft.config import Persistence
        from phoenixft.train.config import SessionConfig
        sess = phoenixft.Session(SessionConfig(run_dir={str(tmp_path / 'run')!r},
                                               persistence=Persistence(url={str(tmp_path / 'ckpt')!r})))
        model = torch.nn.Linear(8, 4)
        sess.setup(model, lambda p: torch.optim.SGD(p, lr=0.1))
        watchers = [t.name for t in threading.enumerate() if t.name.startswith("phoenixft-watch")]
        assert not watchers, watchers
        t0 = time.monotonic()
        for st in sess.steps(10**6):
            for _ in st.microbatches():
                st.backward(model(torch.ones(2, 8)).square().mean())
            if time.monotonic() - t0 > 1.0:
                break
        sess.close()
        print("steps", sess.step)
    """)
    env = {k: v for k, v in os.environ.items() if k != "TORCH_CPP_LOG_LEVEL"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=100, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("steps "), out.stdout
    assert out.stderr == "", out.stderr
