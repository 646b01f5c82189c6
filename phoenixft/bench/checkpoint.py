"""`phoenixft bench checkpoint`: what a checkpoint costs training, and how much it writes.

Side by side in one process (1 process, `--threads` torch threads), on the same model,
optimizer and data, one mode after the other:

- none: the step time with no checkpoint at all (the reference);
- phoenixft: a standalone `Session` with `--persist` to a local directory: each step's
  snapshot copied off the critical path, then a base (every K records) or a delta persisted in
  the background, at the steps its CPU share allows (`--persist-cpu-share`, 5% of a core by
  default: every stride-th step). Stall = the time the training thread waited for a
  snapshot copy; durable = from the end of the step to its manifest; beside it the same
  Session without snapshots or persistence ("phoenixft, no checkpoint"), which is what the
  session itself costs over a plain loop;
- torch.save: model + optimizer state dicts saved synchronously (write then rename);
- dcp.save / dcp.async_save: torch.distributed.checkpoint (async: stall = until the
  call returns plus the wait on the previous save; durable = until its future completes).
Each at one checkpoint per step and one per K steps (the per-step stall is then amortised).
The first `WARM` steps of each run are not timed (step times and stalls alike). Besides
the stall, every mode reports its wall time per step against the plain loop's ("step vs
none"): background work (a writer thread, the persister) costs no stall but competes for
the same cores, and a stall alone would hide that.

Then delta sizes, as a fraction of the full state (model + optimizer as torch.save writes
it), for (a) full fine-tuning with AdamW,
(b) a frozen backbone with LoRA-style adapters training, (c) sparse updates of a large
embedding (SGD: only the looked-up rows change), beside the bytes one dcp.save checkpoint
writes for the same model. The untrained tensors (the frozen backbone) are persisted once
per generation, not per step: shown apart.

Then the session against a plain loop in alternating blocks of 3 steps in one process
(`--pairs` pairs), without checkpoints, with snapshots only, and with snapshots +
persistence: the goal "with vs
without" is the quotient of these two paired ratios, since single runs one after the other
swing 10-20% here from run to run. Each checkpointing block ends by waiting for its
snapshot's commit and for the persister to go idle, so its background work is charged to
it and not to the plain block after it (an upper bound of its cost).

Goals (issue: tiered checkpoints): stall <= 1% of the step at one checkpoint per step;
wall per step with snapshots + persistence <= 1.05x the session without; delta <= 5% of
the full state for (b) and (c); persisted bytes per step for (b) >= 10x fewer than DCP's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

# Steps whose figures are not timed, in every mode alike: the first calls at new shapes,
# first saves, and phoenixft's first writes into fresh shared-memory slots (page faults)
WARM = 2


def _at_least_2(text: str) -> int:
    n = int(text)
    if n < 2:
        raise argparse.ArgumentTypeError(f"needs at least 2 pairs (a standard error), got {n}")
    return n


def register(sub) -> None:
    p = sub.add_parser("checkpoint", help="training stall and bytes written per checkpoint: "
                       "phoenixft tiers vs torch.save vs torch.distributed.checkpoint",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small", choices=["tiny", "small", "ref"])
    p.add_argument("--steps", type=int, default=20, help="measured steps per mode")
    p.add_argument("--every", type=int, default=10, help="K: the per-K-steps frequency and "
                   "phoenixft's base interval")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--persist-cpu-share", type=float, default=0.05,
                   help="phoenixft's persister: its share of one core (as phoenixft run's)")
    p.add_argument("--pairs", type=_at_least_2, default=16, help="block pairs of the session-"
                   "vs-plain-loop comparison (alternating blocks of 3 steps in one process)")
    p.add_argument("--dir", default=None, help="where checkpoints are written (default: a "
                   "temporary directory on local disk)")
    p.add_argument("--out", default="runs/bench/checkpoint.json")
    p.set_defaults(func=cmd_checkpoint)


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
def _plain_run(args, save, tag: str) -> dict:
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


def _torch_save(step, sd, ckpt: Path, pending):
    import torch
    t0 = time.perf_counter()
    tmp = ckpt / f"step{step}.pt.tmp"
    torch.save(sd, tmp)
    os.replace(tmp, ckpt / f"step{step}.pt")
    took = time.perf_counter() - t0
    return took, took


def _dcp_save(step, sd, ckpt: Path, pending):
    import torch.distributed.checkpoint as dcp
    t0 = time.perf_counter()
    dcp.save(sd, checkpoint_id=str(ckpt / f"step{step}"))
    took = time.perf_counter() - t0
    return took, took


def _dcp_async(step, sd, ckpt: Path, pending):
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
def _phoenix_run(args, kind: str, every: int, steps: int, settle: bool = False,
                 checkpoints: bool = True) -> dict:
    """A standalone Session persisting to a local directory (`checkpoints` False: neither
    snapshots nor persistence, the session alone). `settle`: each step first waits for the
    previous one to be durable, so no offer is coalesced and the record kinds (base,
    delta) follow `every` exactly (for the delta sizes, not the timings). Step times are
    whole iterations: microbatches, reduce, update, snapshot begin, waits."""
    from phoenixft.checkpoint.tiers import FsspecTier
    from phoenixft.train.config import SessionConfig
    from phoenixft.train.session import Session

    _quiet_disk()
    root = Path(tempfile.mkdtemp(prefix="phoenixft-", dir=args.dir))
    persist = dict(persist_url=str(root / "ckpt"), persist_every=every, persist_keep=2,
                   persist_cpu_share=1.0 if settle else args.persist_cpu_share)
    sess = Session(SessionConfig(run_dir=str(root / "run"), shm_dir=str(root / "shm"),
                                 **(persist if checkpoints else {"snapshots": False})))
    work = _Workload(args.preset, kind)
    model = work.model
    sess.setup(model, work.optimizer())
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
    if not checkpoints:
        sess.close()
        shutil.rmtree(root, ignore_errors=True)
        return {"step_s": statistics.median(times[WARM:]), "stall_per_step_s": 0.0}
    snap, pers = sess.member.snap.stats, sess.member.persister.stats
    tier = FsspecTier(str(root / "ckpt"))
    delta_bytes = pers.delta_bytes
    fixed = sum(len(tier.fs.cat_file(p)) for p in tier.fs.glob(str(root / "ckpt" / "model" / "*")))
    full = _full_state_bytes(sess, model)
    sess.close()
    shutil.rmtree(root, ignore_errors=True)
    warm = warm or {"stall_s": 0.0, "snapshots": 0}
    return {"step_s": statistics.median(times[WARM:]) if len(times) > WARM + 1 else None,
            "stall_per_step_s": ((snap["stall_s"] - warm["stall_s"])
                                 / max(1, snap["snapshots"] - warm["snapshots"])),
            "durable_s": statistics.median(pers.durable_s) if pers.durable_s else None,
            "records": pers.records, "bases": pers.bases, "coalesced": pers.coalesced,
            "stride": pers.stride, "last_step": pers.last_step,
            "persister_cpu_s_per_step": pers.cpu_s / max(1, steps),
            "delta_bytes": statistics.median(delta_bytes) if delta_bytes else None,
            "full_state_bytes": full, "persist_host_bytes": pers.host_bytes,
            "fixed_bytes_once": fixed,
            "bytes_per_step": pers.bytes_written / max(1, pers.records)}


def _session_vs_plain(args, mode: str, block: int = 3) -> dict:
    """The Session's wall per step against a plain loop's, measured in alternating blocks
    of `block` steps in one process (a plain loop on one copy of the model, the Session on
    another, same data): single runs one after the other swing 10-20% here from run to
    run, more than the differences measured. `mode`: "without" (no snapshots, no
    persistence), "snapshots" (a snapshot every step, nothing persisted) or "with"
    (snapshots, and persistence as `phoenixft` mode 1 does: a base per record, the
    persister's CPU share as given). Returns the mean of the per-pair ratios (session
    block / plain block) with its standard error."""
    from phoenixft.train.config import SessionConfig
    from phoenixft.train.session import Session

    _quiet_disk()
    plain = _Workload(args.preset, "full")
    opt = plain.optimizer()(list(plain.model.parameters()))
    root = Path(tempfile.mkdtemp(prefix="phoenixft-", dir=args.dir))
    extra = {"without": {"snapshots": False}, "snapshots": {},
             "with": dict(persist_url=str(root / "ckpt"), persist_every=1, persist_keep=2,
                          persist_cpu_share=args.persist_cpu_share)}[mode]
    sess = Session(SessionConfig(run_dir=str(root / "run"), shm_dir=str(root / "shm"), **extra))
    work = _Workload(args.preset, "full")
    sess.setup(work.model, work.optimizer())
    warm = 2  # pairs not timed: first calls, allocations, the persister's first records
    total = (args.pairs + warm) * block + 1
    steps = sess.steps(total)
    ratios, step = [], 0
    try:
        for i in range(args.pairs + warm):
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
            if i >= warm:
                ratios.append((t2 - t1) / (t1 - t0))
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


def _full_state_bytes(sess, model) -> int:
    """What a full checkpoint of this model holds: every model tensor (frozen included)
    and the optimizer state, as torch.save / DCP write them."""
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    for v in sess.optimizer.state.values():
        size += sum(t.numel() * t.element_size() for t in v.values() if hasattr(t, "numel"))
    return size


def _dcp_bytes(args, kind: str) -> int:
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


# -- the command ----------------------------------------------------------------------------
def cmd_checkpoint(args) -> int:
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # store waits time out by design
    import torch

    torch.set_num_threads(args.threads)
    if args.dir:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    print(f"[checkpoint] {args.preset} preset, {args.steps} steps per mode, K={args.every}, "
          f"1 process x {args.threads} torch threads", flush=True)
    modes = {"none": _plain_run(args, None, "none")}
    for name, fn in (("torch.save", _torch_save), ("dcp.save", _dcp_save),
                     ("dcp.async_save", _dcp_async)):
        print(f"[checkpoint] {name}", flush=True)
        modes[name] = _plain_run(args, fn, name.replace(".", "_"))
    print("[checkpoint] phoenixft", flush=True)
    modes["phoenixft, no checkpoint"] = {1: _phoenix_run(args, "full", 1, args.steps,
                                                         checkpoints=False)}
    print("[checkpoint] the session vs a plain loop, alternating blocks", flush=True)
    session_vs_plain = {m: _session_vs_plain(args, m) for m in ("without", "snapshots", "with")}
    modes["phoenixft"] = {1: _phoenix_run(args, "full", 1, args.steps),
                          args.every: _phoenix_run(args, "full", args.every, args.steps)}
    for by_freq in modes.values():  # wall per step, waits included, against the plain loop
        for r in by_freq.values():
            wall = r["step_s"] + (0.0 if "stall_per_ckpt_s" not in r else r["stall_per_step_s"])
            r["step_vs_none"] = wall / modes["none"][1]["step_s"]
    base_step = modes["none"][1]["step_s"]
    scenarios = {}
    for kind, label in (("full", "(a) full fine-tuning"),
                        ("adapters", "(b) frozen backbone, LoRA adapters"),
                        ("embedding", "(c) sparse embedding updates")):
        print(f"[checkpoint] delta sizes: {label}", flush=True)
        r = _phoenix_run(args, kind, args.every, args.every + 4, settle=True)
        r["dcp_bytes"] = _dcp_bytes(args, kind)
        r["delta_fraction"] = (r["delta_bytes"] or 0) / r["full_state_bytes"]
        r["label"] = label
        scenarios[kind] = r
    goals = _goals(modes, scenarios, base_step, session_vs_plain)
    result = {"benchmark": "checkpoint", "preset": args.preset, "steps": args.steps,
              "every": args.every, "processes": 1, "threads": args.threads,
              "cpu_count": os.cpu_count(), "step_s": base_step,
              "modes": {m: {str(k): v for k, v in r.items()} for m, r in modes.items()},
              "scenarios": scenarios, "session_vs_plain": session_vs_plain, "goals": goals,
              "bench_wall_s": time.time() - t_start}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    _print(result)
    print(f"wrote {args.out}")
    return 0


def _goals(modes: dict, scenarios: dict, step_s: float, paired: dict) -> list[dict]:
    stall = modes["phoenixft"][1]["stall_per_step_s"] / step_s
    b = scenarios["adapters"]
    ratio = b["dcp_bytes"] / max(1.0, b["bytes_per_step"])
    cost, cost_se = paired_cost(paired)
    return [
        {"name": "phoenixft stall at one checkpoint per step", "goal": "<= 1% of a step",
         "measured": f"{100 * stall:.2f}%", "met": stall <= 0.01},
        {"name": "phoenixft wall per step with snapshots + persistence offered every step, vs "
                 "the same session without", "goal": "<= 1.05x",
         "measured": f"{cost:.3f}x +- {cost_se:.3f} (paired blocks, each against a plain "
                     f"loop; persisting every {paired['with']['stride']}th step at the end)",
         "met": cost <= 1.05},
        {"name": "delta size, frozen backbone + adapters", "goal": "<= 5% of the full state",
         "measured": f"{100 * b['delta_fraction']:.2f}%", "met": b["delta_fraction"] <= 0.05},
        {"name": "delta size, sparse embedding updates", "goal": "<= 5% of the full state",
         "measured": f"{100 * scenarios['embedding']['delta_fraction']:.2f}%",
         "met": scenarios["embedding"]["delta_fraction"] <= 0.05},
        {"name": "persisted bytes per step, frozen backbone + adapters, vs one DCP checkpoint",
         "goal": ">= 10x fewer", "measured": f"{ratio:.1f}x fewer", "met": ratio >= 10},
    ]


COST_COLUMNS = ("mode", "every (steps)", "stall per checkpoint ms", "stall, % of a step",
                "wall per step vs no checkpoint", "durable after ms", "bytes per checkpoint")


def cost_rows(result: dict) -> list[tuple[str, ...]]:
    """Every mode's cost (`COST_COLUMNS`): the training thread's stall, and its wall per
    step against the plain loop's (background work competes for the same cores: a stall
    alone hides it)."""
    rows = []
    for mode, by_freq in result["modes"].items():
        if mode == "none":
            continue
        for freq, r in by_freq.items():
            per_ckpt = r.get("stall_per_ckpt_s", r["stall_per_step_s"])
            rows.append((mode, str(freq), f"{1000 * per_ckpt:.1f}",
                         f"{100 * r['stall_per_step_s'] / result['step_s']:.2f}%",
                         f"{r['step_vs_none']:.2f}x",
                         "-" if r.get("durable_s") is None else f"{1000 * r['durable_s']:.0f}",
                         f"{r.get('bytes_per_ckpt', r.get('bytes_per_step', 0)):.3g}"))
    return rows


def paired_cost(paired: dict) -> tuple[float, float]:
    """The session with checkpoints against the session without, from their two paired
    ratios against a plain loop (so the machine's drift between the two cancels), with
    the standard error of the quotient."""
    w, wo = paired["with"], paired["without"]
    q = w["mean"] / wo["mean"]
    return q, q * ((w["se"] / w["mean"]) ** 2 + (wo["se"] / wo["mean"]) ** 2) ** 0.5


def session_line(result: dict) -> str:
    """The session's wall per step against a plain loop, measured in alternating blocks."""
    p = result.get("session_vs_plain")
    if not p:
        return ""
    wo, w = p["without"], p["with"]
    snap = p.get("snapshots")
    snaps = (f"; with snapshots, nothing persisted, {snap['mean']:.3f}x +- {snap['se']:.3f}"
             if snap else "")
    return (f"Against a plain loop, in {wo['pairs']} alternating pairs of {wo['block']}-step "
            f"blocks in one process (mean of the pair ratios +- standard error): the session "
            f"alone {wo['mean']:.3f}x +- {wo['se']:.3f}{snaps}; with snapshots and persistence "
            f"{w['mean']:.3f}x +- {w['se']:.3f} ({w['records']} records in "
            f"{w['steps']} steps). The table's single runs, one mode "
            f"after the other, swing more than that from run to run.")


def _print(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    from .harness import print_goals

    console = Console(width=max(Console().width, 150))
    step_s = result["step_s"]
    t = Table(title=f"checkpoint cost: {result['preset']} preset, step {1000 * step_s:.0f} ms "
                    f"without checkpoints; 1 process x {result['threads']} torch threads")
    for col in COST_COLUMNS:
        t.add_column(col)
    for row in cost_rows(result):
        t.add_row(*row)
    console.print(t)
    console.print(session_line(result))
    d = Table(title="bytes written per step: phoenixft deltas vs the full state and one DCP "
                    "checkpoint")
    for col in ("scenario", "full state", "phoenixft delta", "delta / full",
                "phoenixft bytes/step (bases incl.)", "untrained, once", "DCP checkpoint",
                "DCP / phoenixft per step"):
        d.add_column(col)
    for r in result["scenarios"].values():
        d.add_row(r["label"], f"{r['full_state_bytes']:.3g}", f"{r['delta_bytes'] or 0:.3g}",
                  f"{100 * r['delta_fraction']:.2f}%", f"{r['bytes_per_step']:.3g}",
                  f"{r['fixed_bytes_once']:.3g}", f"{r['dcp_bytes']:.3g}",
                  f"{r['dcp_bytes'] / max(1, r['bytes_per_step']):.1f}x")
    console.print(d)
    print_goals(console, result["goals"])
