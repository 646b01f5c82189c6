"""`phoenixft bench checkpoint`: what a checkpoint costs training, and how much it writes.

Side by side in one process (1 process, `--threads` torch threads), on the same model,
optimizer and data, one mode after the other:

- none: the step time with no checkpoint at all (the reference);
- phoenixft: a standalone `Session` with `--persist` to a local directory: each step's
  snapshot copied off the critical path, then a base (every K steps) or a delta persisted in
  the background. Stall = the time the training thread waited for a snapshot copy;
  durable = from the end of the step to its manifest;
- torch.save: model + optimizer state dicts saved synchronously (write then rename);
- dcp.save / dcp.async_save: torch.distributed.checkpoint (async: stall = until the
  call returns plus the wait on the previous save; durable = until its future completes).
Each at one checkpoint per step and one per K steps (the per-step stall is then amortised).

Then delta sizes, as a fraction of the full state (model + optimizer as torch.save writes
it), for (a) full fine-tuning with AdamW, (b) a frozen backbone with only the last block and
the head training, (c) sparse updates of a large embedding (SGD: only the looked-up rows
change), beside the bytes one dcp.save checkpoint writes for the same model.

Goals (issue: tiered checkpoints): stall <= 1% of the step at one checkpoint per step;
delta <= 5% of the full state for (b) and (c); persisted bytes per step for (b) >= 10x fewer
than DCP's.
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


def register(sub) -> None:
    p = sub.add_parser("checkpoint", help="training stall and bytes written per checkpoint: "
                       "phoenixft tiers vs torch.save vs torch.distributed.checkpoint",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small", choices=["tiny", "small", "ref"])
    p.add_argument("--steps", type=int, default=20, help="measured steps per mode")
    p.add_argument("--every", type=int, default=10, help="K: the per-K-steps frequency and "
                   "phoenixft's base interval")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dir", default=None, help="where checkpoints are written (default: a "
                   "temporary directory on local disk)")
    p.add_argument("--out", default="runs/bench/checkpoint.json")
    p.set_defaults(func=cmd_checkpoint)


# -- the workload ------------------------------------------------------------------------
def _model(preset: str, kind: str = "full"):
    import torch

    from phoenixft.models.llama import LlamaForCausalLM
    from phoenixft.models.llama import preset as cfg_of

    torch.manual_seed(0)
    cfg = cfg_of(preset)
    if kind == "embedding":  # a large table, most rows untouched by any one batch
        cfg.vocab_size = 32_768
    model = LlamaForCausalLM(cfg)
    if kind == "frozen":  # only the last block and the head train
        for name, p in model.named_parameters():
            last = f"layers.{cfg.num_hidden_layers - 1}." in name or name.startswith("lm_head") \
                or name == "model.norm.weight"
            p.requires_grad_(last)
        if model.config.tie_word_embeddings:
            model.model.embed_tokens.weight.requires_grad_(False)
    return model, cfg


def _optimizer(kind: str):
    import torch
    if kind == "embedding":
        return lambda params: torch.optim.SGD(params, lr=0.1)
    return lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def _batch(cfg, step: int, kind: str):
    import torch
    g = torch.Generator().manual_seed(step)
    hi = 256 if kind != "embedding" else cfg.vocab_size
    x = torch.randint(0, hi, (4, cfg.max_position_embeddings // 2), generator=g)
    return x, x.roll(-1, dims=1)


def _train_step(model, x, y):
    import torch.nn.functional as F
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


# -- baselines -----------------------------------------------------------------------------
def _plain_run(args, save, tag: str) -> dict:
    """A plain loop with a torch optimizer and `save(step, sd, ckpt_dir)` -> (stall_s,
    wait_durable) every checkpoint step; returns the figures."""
    import torch

    model, cfg = _model(args.preset)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    out = {}
    for freq in (1, args.every):
        ckpt = Path(tempfile.mkdtemp(prefix=f"{tag}-", dir=args.dir))
        steps, stalls, durable, pending = [], [], [], []
        for step in range(1, args.steps + 1):
            t0 = time.perf_counter()
            x, y = _batch(cfg, step, "full")
            loss = _train_step(model, x, y)
            loss.backward()
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
        out[freq] = {"step_s": statistics.median(steps[2:]), "stall_per_ckpt_s":
                     statistics.mean([s for s in stalls if s] or [0.0]),
                     "stall_per_step_s": sum(stalls) / len(stalls),
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


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


# -- phoenixft -----------------------------------------------------------------------------
def _phoenix_run(args, kind: str, every: int, steps: int) -> dict:
    """A standalone Session persisting to a local directory."""
    from phoenixft.checkpoint.tiers import FsspecTier
    from phoenixft.train.config import SessionConfig
    from phoenixft.train.session import Session

    root = Path(tempfile.mkdtemp(prefix="phoenixft-", dir=args.dir))
    sess = Session(SessionConfig(run_dir=str(root / "run"), shm_dir=str(root / "shm"),
                                 persist_url=str(root / "ckpt"), persist_every=every,
                                 persist_keep=2))
    model, cfg = _model(args.preset, kind)
    sess.setup(model, _optimizer(kind))
    times = []
    for st in sess.steps(steps):
        t0 = time.perf_counter()
        for _ in st.microbatches():
            x, y = _batch(cfg, st.index, kind)
            st.backward(_train_step(model, x, y))
        times.append(time.perf_counter() - t0)
    snap, pers = sess.member.snap.stats, sess.member.persister.stats
    tier = FsspecTier(str(root / "ckpt"))
    deltas = [r for r in tier.list() if r.kind == "delta"]
    delta_bytes = [len(tier.fs.cat_file(tier.record_path(r.step, 0, "delta"))) for r in deltas]
    full = _full_state_bytes(sess, model)
    sess.close()
    shutil.rmtree(root, ignore_errors=True)
    return {"step_s": statistics.median(times[2:]) if len(times) > 3 else None,
            "stall_per_step_s": snap["stall_s"] / max(1, snap["snapshots"]),
            "durable_s": statistics.median(pers.durable_s) if pers.durable_s else None,
            "records": pers.records, "bases": pers.bases, "coalesced": pers.coalesced,
            "delta_bytes": statistics.median(delta_bytes) if delta_bytes else None,
            "full_state_bytes": full, "persist_host_bytes": pers.host_bytes,
            "bytes_per_step": pers.bytes_written / max(1, pers.records)}


def _full_state_bytes(sess, model) -> int:
    """What a full checkpoint of this model holds: every model tensor (frozen included)
    and the optimizer state, as torch.save / DCP write them."""
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    for v in sess.state.opt.inner.state.values():
        size += sum(t.numel() * t.element_size() for t in v.values() if hasattr(t, "numel"))
    return size


def _dcp_bytes(args, kind: str) -> int:
    """Bytes of one dcp.save of the scenario's model + optimizer after a step."""
    import torch.distributed.checkpoint as dcp

    model, cfg = _model(args.preset, kind)
    opt = _optimizer(kind)([p for p in model.parameters() if p.requires_grad])
    x, y = _batch(cfg, 1, kind)
    _train_step(model, x, y).backward()
    opt.step()
    d = Path(tempfile.mkdtemp(prefix="dcp-", dir=args.dir))
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=str(d))
    size = _dir_bytes(d)
    shutil.rmtree(d, ignore_errors=True)
    return size


# -- the command ----------------------------------------------------------------------------
def cmd_checkpoint(args) -> int:
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
    modes["phoenixft"] = {1: _phoenix_run(args, "full", 1, args.steps),
                          args.every: _phoenix_run(args, "full", args.every, args.steps)}
    base_step = modes["none"][1]["step_s"]
    scenarios = {}
    for kind, label in (("full", "(a) full fine-tuning"), ("frozen", "(b) frozen backbone"),
                        ("embedding", "(c) sparse embedding updates")):
        print(f"[checkpoint] delta sizes: {label}", flush=True)
        r = _phoenix_run(args, kind, args.every, min(args.steps, 12))
        r["dcp_bytes"] = _dcp_bytes(args, kind)
        r["delta_fraction"] = (r["delta_bytes"] or 0) / r["full_state_bytes"]
        r["label"] = label
        scenarios[kind] = r
    goals = _goals(modes, scenarios, base_step)
    result = {"benchmark": "checkpoint", "preset": args.preset, "steps": args.steps,
              "every": args.every, "processes": 1, "threads": args.threads,
              "cpu_count": os.cpu_count(), "step_s": base_step,
              "modes": {m: {str(k): v for k, v in r.items()} for m, r in modes.items()},
              "scenarios": scenarios, "goals": goals, "bench_wall_s": time.time() - t_start}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    _print(result)
    print(f"wrote {args.out}")
    return 0


def _goals(modes: dict, scenarios: dict, step_s: float) -> list[dict]:
    stall = modes["phoenixft"][1]["stall_per_step_s"] / step_s
    b = scenarios["frozen"]
    ratio = b["dcp_bytes"] / max(1.0, b["bytes_per_step"])
    return [
        {"name": "phoenixft stall at one checkpoint per step", "goal": "<= 1% of a step",
         "measured": f"{100 * stall:.2f}%", "met": stall <= 0.01},
        {"name": "delta size, frozen backbone", "goal": "<= 5% of the full state",
         "measured": f"{100 * b['delta_fraction']:.2f}%", "met": b["delta_fraction"] <= 0.05},
        {"name": "delta size, sparse embedding updates", "goal": "<= 5% of the full state",
         "measured": f"{100 * scenarios['embedding']['delta_fraction']:.2f}%",
         "met": scenarios["embedding"]["delta_fraction"] <= 0.05},
        {"name": "persisted bytes per step, frozen backbone, vs one DCP checkpoint",
         "goal": ">= 10x fewer", "measured": f"{ratio:.1f}x fewer", "met": ratio >= 10},
    ]


def _print(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 150))
    step_s = result["step_s"]
    t = Table(title=f"checkpoint cost: {result['preset']} preset, step {1000 * step_s:.0f} ms "
                    f"without checkpoints; 1 process x {result['threads']} torch threads")
    for col in ("mode", "every", "stall/ckpt ms", "stall/step % of step", "durable after ms",
                "bytes/ckpt"):
        t.add_column(col)
    for mode, by_freq in result["modes"].items():
        if mode == "none":
            continue
        for freq, r in by_freq.items():
            per_ckpt = r.get("stall_per_ckpt_s", r["stall_per_step_s"])
            t.add_row(mode, f"{freq} step(s)", f"{1000 * per_ckpt:.1f}",
                      f"{100 * r['stall_per_step_s'] / step_s:.2f}%",
                      "-" if r.get("durable_s") is None else f"{1000 * r['durable_s']:.0f}",
                      f"{r.get('bytes_per_ckpt', r.get('bytes_per_step', 0)):.3g}")
    console.print(t)
    d = Table(title="bytes written per step: phoenixft deltas vs the full state and one DCP "
                    "checkpoint")
    for col in ("scenario", "full state", "phoenixft delta", "delta / full", "DCP checkpoint",
                "DCP / phoenixft per step"):
        d.add_column(col)
    for r in result["scenarios"].values():
        d.add_row(r["label"], f"{r['full_state_bytes']:.3g}", f"{r['delta_bytes'] or 0:.3g}",
                  f"{100 * r['delta_fraction']:.2f}%", f"{r['dcp_bytes']:.3g}",
                  f"{r['dcp_bytes'] / max(1, r['bytes_per_step']):.1f}x")
    console.print(d)
    g = Table(title="goals")
    for col in ("goal", "target", "measured", "met"):
        g.add_column(col)
    for x in result["goals"]:
        g.add_row(x["name"], x["goal"], x["measured"], "yes" if x["met"] else "NO")
    console.print(g)
