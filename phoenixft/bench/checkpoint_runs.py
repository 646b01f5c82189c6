"""The runs `phoenixft bench checkpoint` times (see its docstring): the three workloads, a
plain loop with torch.save / dcp.save / dcp.async_save, the phoenixft Session persisting
to a local directory, the Session against a plain loop in alternating blocks, and one DCP
checkpoint's bytes. Each returns its figures as a dict; checkpoint.py puts them together."""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

# Steps whose figures are not timed, in every mode alike: the first calls at new shapes,
# first saves, and phoenixft's first writes into fresh shared-memory slots (page faults)
WARM = 2

SAVES = {}  # filled below: mode name -> save function of a plain loop


# -- the workloads -----------------------------------------------------------------------
def _lora(base, rank: int = 4):
    """A LoRA-style adapter around a frozen linear layer: base(x) + B(A(x)), B from zero."""
    import torch
    from torch import nn

    class LoRALinear(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.base = base.requires_grad_(False)
            self.a = nn.Parameter(torch.randn(rank, base.in_features) / base.in_features ** 0.5)
            self.b = nn.Parameter(torch.zeros(base.out_features, rank))

        def forward(self, x):
            return self.base(x) + (x @ self.a.T) @ self.b.T

    return LoRALinear()


class _Workload:
    """One scenario: a model, its optimizer factory, and batches as a function of the step.
    full: the preset Llama, every weight trained (AdamW); adapters: the same Llama frozen,
    LoRA adapters (rank 4) on every attention projection trained (AdamW); embedding: a
    1M x 16 embedding table and a small head, 256 rows looked up per step (SGD: only those
    rows change)."""

    def __init__(self, preset: str, kind: str) -> None:
        import torch
        from torch import nn

        from phoenixft.models.llama import LlamaForCausalLM
        from phoenixft.models.llama import preset as cfg_of

        torch.manual_seed(0)
        self.kind = kind
        if kind == "embedding":
            self.model = nn.Sequential(nn.Embedding(1_000_000, 16), nn.Linear(16, 32), nn.Tanh(),
                                       nn.Linear(32, 1))
            return
        self.cfg = cfg_of(preset)
        self.model = LlamaForCausalLM(self.cfg)
        if kind == "adapters":
            self.model.requires_grad_(False)
            for layer in self.model.model.layers:
                att = layer.self_attn
                for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                    setattr(att, name, _lora(getattr(att, name)))

    def optimizer(self):
        import torch
        if self.kind == "embedding":
            return lambda params: torch.optim.SGD(params, lr=0.1)
        return lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)

    def loss(self, step: int):
        import torch
        import torch.nn.functional as F
        g = torch.Generator().manual_seed(step)
        if self.kind == "embedding":
            ids = torch.randint(0, 1_000_000, (256,), generator=g)
            return F.mse_loss(self.model(ids).squeeze(-1), torch.randn(256, generator=g))
        x = torch.randint(0, 256, (4, self.cfg.max_position_embeddings // 2), generator=g)
        return F.cross_entropy(self.model(x).flatten(0, 1), x.roll(-1, dims=1).flatten())


# -- baselines -----------------------------------------------------------------------------
def plain_run(args, save, tag: str) -> dict:
    """A plain loop with a torch optimizer and `save(step, sd, ckpt_dir)` -> (stall_s,
    wait_durable) every checkpoint step; returns the figures."""
    work = _Workload(args.preset, "full")
    model = work.model
    opt = work.optimizer()(list(model.parameters()))
    out = {}
    for freq in (1, args.every):
        _quiet_disk()
        ckpt = Path(tempfile.mkdtemp(prefix=f"{tag}-", dir=args.dir))
        steps, stalls, durable, pending = [], [], [], []
        for step in range(1, args.steps + 1):
            t0 = time.perf_counter()
            work.loss(step).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            t1 = time.perf_counter()
            stall = 0.0
            if save is not None and step % freq == 0:
                sd = {"model": model.state_dict(), "optim": opt.state_dict()}
                stall, finish = save(step, sd, ckpt, pending)
                durable.append(finish)
            steps.append(t1 - t0)
            stalls.append(stall)
        for f in pending:
            f()
        durable = [d() if callable(d) else d for d in durable]
        timed = stalls[WARM:]
        out[freq] = {"step_s": statistics.median(steps[WARM:]), "stall_per_ckpt_s":
                     statistics.mean([s for s in timed if s] or [0.0]),
                     "stall_per_step_s": sum(timed) / len(timed),
                     "durable_s": statistics.median(durable) if durable else None,
                     "bytes_per_ckpt": _dir_bytes(ckpt) / max(1, len(durable)) if save else 0}
        shutil.rmtree(ckpt, ignore_errors=True)
    return out


def torch_save(step, sd, ckpt: Path, pending):
    import torch
    t0 = time.perf_counter()
    tmp = ckpt / f"step{step}.pt.tmp"
    torch.save(sd, tmp)
    os.replace(tmp, ckpt / f"step{step}.pt")
    took = time.perf_counter() - t0
    return took, took


def dcp_save(step, sd, ckpt: Path, pending):
    import torch.distributed.checkpoint as dcp
    t0 = time.perf_counter()
    dcp.save(sd, checkpoint_id=str(ckpt / f"step{step}"))
    took = time.perf_counter() - t0
    return took, took


def dcp_async(step, sd, ckpt: Path, pending):
    import torch.distributed.checkpoint as dcp
    t0 = time.perf_counter()
    while pending:  # the previous save must finish before a new one may start
        pending.pop(0)()
    fut = dcp.async_save(sd, checkpoint_id=str(ckpt / f"step{step}"))
    stall = time.perf_counter() - t0
    done: dict = {}

    def wait() -> float:
        if "t" not in done:
            fut.result()
            done["t"] = time.perf_counter() - t0
        return done["t"]

    pending.append(wait)
    return stall, wait


def _quiet_disk() -> None:
    """Write back every dirty page before a mode starts: the modes before it wrote GBs
    (torch.save and DCP at every step), and the kernel's write-back of those took CPU from
    whichever mode ran next (the session without checkpoints came out 1.43x a plain loop in
    one such run, 1.00x when measured in alternating blocks)."""
    os.sync()


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


# -- phoenixft -----------------------------------------------------------------------------
def phoenix_run(args, kind: str, every: int, steps: int, settle: bool = False,
                checkpoints: bool = True) -> dict:
    """A standalone Session persisting to a local directory (`checkpoints` False: neither
    snapshots nor persistence, the session alone). `settle`: each step first waits for the
    previous one to be durable, so no offer is coalesced and the record kinds (base,
    delta) follow `every` exactly (for the delta sizes, not the timings). Step times are
    whole iterations: microbatches, reduce, update, snapshot begin, waits."""
    from phoenixft.config import Persistence, Snapshots
    from phoenixft.train.config import SessionConfig
    from phoenixft.train.session import Session

    _quiet_disk()
    root = Path(tempfile.mkdtemp(prefix="phoenixft-", dir=args.dir))
    persist = Persistence(url=str(root / "ckpt"), every=every, keep=2,
                          cpu_share=1.0 if settle else args.persist_cpu_share)
    sess = Session(SessionConfig(run_dir=str(root / "run"), shm_dir=str(root / "shm"),
                                 **({"persistence": persist} if checkpoints
                                    else {"snapshots": Snapshots(enabled=False)})))
    work = _Workload(args.preset, kind)
    sess.setup(work.model, work.optimizer())
    times, warm = _timed_steps(sess, work, steps, settle, checkpoints)
    if not checkpoints:
        sess.close()
        shutil.rmtree(root, ignore_errors=True)
        return {"step_s": statistics.median(times[WARM:]), "stall_per_step_s": 0.0}
    out = _persisted_figures(sess, work.model, root, steps, warm)
    sess.close()
    shutil.rmtree(root, ignore_errors=True)
    return {"step_s": statistics.median(times[WARM:]) if len(times) > WARM + 1 else None,
            **out}


def _timed_steps(sess, work: _Workload, steps: int, settle: bool,
                 checkpoints: bool) -> tuple[list[float], dict | None]:
    """Each step's whole iteration, and the snapshot stats when timing starts (after WARM)."""
    times, warm, t0 = [], None, None
    for st in sess.steps(steps):
        now = time.perf_counter()
        if t0 is not None:
            times.append(now - t0)
        if st.index == WARM + 1 and warm is None:  # stalls from here on are timed
            warm = dict(sess.member.snap.stats) if checkpoints else {}
        if settle and st.index > 1:
            sess.member.persister.flush(st.index - 1, 60)
        t0 = time.perf_counter()
        for _ in st.microbatches():
            st.backward(work.loss(st.index))
    times.append(time.perf_counter() - t0)  # the last step, completed as the loop ended
    return times, warm


def _persisted_figures(sess, model, root: Path, steps: int, warm: dict | None) -> dict:
    """The stall per snapshot after warm-up, and what the persister wrote (and how often)."""
    from phoenixft.checkpoint.tiers import FsspecTier

    snap, pers = sess.member.snap.stats, sess.member.persister.stats
    tier = FsspecTier(str(root / "ckpt"))
    delta_bytes = pers.delta_bytes
    fixed = sum(len(tier.fs.cat_file(p)) for p in tier.fs.glob(str(root / "ckpt" / "model" / "*")))
    warm = warm or {"stall_s": 0.0, "snapshots": 0}
    return {"stall_per_step_s": ((snap["stall_s"] - warm["stall_s"])
                                 / max(1, snap["snapshots"] - warm["snapshots"])),
            "durable_s": statistics.median(pers.durable_s) if pers.durable_s else None,
            "records": pers.records, "bases": pers.bases, "coalesced": pers.coalesced,
            "stride": pers.stride, "last_step": pers.last_step,
            "persister_cpu_s_per_step": pers.cpu_s / max(1, steps),
            "delta_bytes": statistics.median(delta_bytes) if delta_bytes else None,
            "full_state_bytes": _full_state_bytes(sess, model),
            "persist_host_bytes": pers.host_bytes, "fixed_bytes_once": fixed,
            "bytes_per_step": pers.bytes_written / max(1, pers.records)}


def session_vs_plain(args, mode: str, block: int = 3) -> dict:
    """The Session's wall per step against a plain loop's, measured in alternating blocks
    of `block` steps in one process (a plain loop on one copy of the model, the Session on
    another, same data): single runs one after the other swing 10-20% here from run to
    run, more than the differences measured. `mode`: "without" (no snapshots, no
    persistence), "snapshots" (a snapshot every step, nothing persisted) or "with"
    (snapshots, and persistence as `phoenixft` mode 1 does: a base per record, the
    persister's CPU share as given). Returns the mean of the per-pair ratios (session
    block / plain block) with its standard error."""
    from phoenixft.config import Persistence, Snapshots
    from phoenixft.train.config import SessionConfig
    from phoenixft.train.session import Session

    _quiet_disk()
    plain = _Workload(args.preset, "full")
    opt = plain.optimizer()(list(plain.model.parameters()))
    root = Path(tempfile.mkdtemp(prefix="phoenixft-", dir=args.dir))
    extra = {"without": {"snapshots": Snapshots(enabled=False)}, "snapshots": {},
             "with": {"persistence": Persistence(url=str(root / "ckpt"), every=1, keep=2,
                                                 cpu_share=args.persist_cpu_share)}}[mode]
    sess = Session(SessionConfig(run_dir=str(root / "run"), shm_dir=str(root / "shm"), **extra))
    work = _Workload(args.preset, "full")
    sess.setup(work.model, work.optimizer())
    warm = 2  # pairs not timed: first calls, allocations, the persister's first records
    total = (args.pairs + warm) * block + 1
    steps = sess.steps(total)
    try:
        ratios = [r for i, r in enumerate(_block_pairs(plain, opt, sess, work, steps, mode,
                                                       args.pairs + warm, block)) if i >= warm]
        for st in steps:  # the last step, then the session's end
            for _ in st.microbatches():
                st.backward(work.loss(st.index))
        pers = sess.member.persister
        records, stride = (pers.stats.records, pers.stats.stride) if pers else (0, None)
    finally:
        sess.close()
        shutil.rmtree(root, ignore_errors=True)
    mean = statistics.mean(ratios)
    se = statistics.stdev(ratios) / len(ratios) ** 0.5 if len(ratios) > 1 else float("nan")
    return {"mean": mean, "se": se, "pairs": len(ratios), "block": block, "steps": total,
            "records": records, "stride": stride}


def _block_pairs(plain: _Workload, opt, sess, work: _Workload, steps, mode: str, pairs: int,
                 block: int) -> list[float]:
    """`pairs` times: `block` plain steps, then `block` session steps; each pair's ratio."""
    ratios, step = [], 0
    for _ in range(pairs):
        t0 = time.perf_counter()
        for k in range(block):
            plain.loss(step + k + 1).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        t1 = time.perf_counter()
        for _ in range(block):  # each next() completes the step before (reduce, update)
            st = next(steps)
            for _ in st.microbatches():
                st.backward(work.loss(st.index))
        if mode != "without":  # the block's background work is charged to it, not to
            # the plain block after it: its snapshot committed, its record written (an
            # upper bound: what would have overlapped the next steps is waited for here)
            sess.member.snap.wait_copied(committed=True)
            if sess.member.persister is not None:
                sess.member.persister.wait_idle(60)
        t2 = time.perf_counter()
        step += block
        ratios.append((t2 - t1) / (t1 - t0))
    return ratios


def _full_state_bytes(sess, model) -> int:
    """What a full checkpoint of this model holds: every model tensor (frozen included)
    and the optimizer state, as torch.save / DCP write them."""
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    for v in sess.optimizer.state.values():
        size += sum(t.numel() * t.element_size() for t in v.values() if hasattr(t, "numel"))
    return size


def dcp_bytes(args, kind: str) -> int:
    """Bytes of one dcp.save of the scenario's model + optimizer after a step."""
    import torch.distributed.checkpoint as dcp

    work = _Workload(args.preset, kind)
    model = work.model
    opt = work.optimizer()([p for p in model.parameters() if p.requires_grad])
    work.loss(1).backward()
    opt.step()
    d = Path(tempfile.mkdtemp(prefix="dcp-", dir=args.dir))
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=str(d))
    size = _dir_bytes(d)
    shutil.rmtree(d, ignore_errors=True)
    return size


SAVES.update({"torch.save": torch_save, "dcp.save": dcp_save, "dcp.async_save": dcp_async})
