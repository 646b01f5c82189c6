"""`phoenixft ckpt ls|verify|inspect|export URL`: operators' view of persisted checkpoints
(a directory or s3://bucket/prefix)."""

from __future__ import annotations

import argparse
import json
import sys
import time


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ckpt", help="list, verify, inspect or export persisted checkpoints")
    verbs = p.add_subparsers(dest="verb", metavar="VERB", required=True)
    ls = verbs.add_parser("ls", help="committed steps (manifests), newest last")
    verify = verbs.add_parser("verify", help="read every record of every kept step (or one) "
                              "and check its checksums, and every checkpoint in DCP's format "
                              "(checkpoint/step-N, or URL itself)")
    verify.add_argument("--step", type=int, default=None)
    inspect = verbs.add_parser("inspect", help="a step's manifest, records and tensors")
    inspect.add_argument("--step", type=int, default=None, help="default: the newest")
    export = verbs.add_parser("export", help="a step as a Hugging Face model directory, or "
                              "(--format dcp) as a torch.distributed.checkpoint checkpoint")
    export.add_argument("--step", type=int, default=None, help="default: the newest")
    export.add_argument("--to", required=True, help="output directory (new or empty)")
    export.add_argument("--format", choices=["hf", "dcp"], default="hf",
                        help="hf: config.json + model.safetensors (the model); dcp: DCP's "
                             "default format (.metadata + .distcp) with the model, the "
                             "optimizer state and the step under torchtitan's keys, which "
                             "dcp.load(state, checkpoint_id=DIR) and --init-from read")
    export.add_argument("--force", action="store_true", help="write into a non-empty --to "
                        "directory (its config.json and model.safetensors are replaced)")
    for v in (ls, verify, inspect, export):
        v.add_argument("url", help="the --persist URL of the job")
    p.set_defaults(func=cmd_ckpt)


def _tier(url: str):
    """The URL's tier; LookupError when nothing is there (a mistyped path must not read
    as an empty checkpoint directory)."""
    from phoenixft.checkpoint.tiers import FsspecTier
    tier = FsspecTier(url)
    try:  # (info, not exists: an object store's exists() says False for no credentials)
        tier.fs.info(tier.root)
    except FileNotFoundError:
        raise LookupError(f"{url}: no such directory (or object-store prefix): nothing to "
                          "read") from None
    return tier


def _step(tier, step: int | None) -> int:
    """`step` if committed, else (None) the newest readable committed step; a newer
    manifest that cannot be read is named on stderr and passed over."""
    from phoenixft.checkpoint.manifests import scan
    steps = tier.manifests()
    if not steps:
        raise LookupError(f"{tier.url} holds no committed checkpoint (no manifest)")
    if step is not None:
        if step not in steps:
            raise LookupError(f"{tier.url} has no committed step {step}; it has {steps}")
        return step
    found = scan(tier)
    for why in found.bad.values():
        print(f"phoenixft ckpt: warning: passed over {why}", file=sys.stderr)
    if not found.good:
        raise LookupError(f"{tier.url}: no readable manifest (all {len(found.bad)} are damaged)")
    return found.steps[-1]


def cmd_ckpt(args) -> int:
    from phoenixft.checkpoint.integrity import IntegrityError
    from phoenixft.checkpoint.storage_errors import explain
    try:
        return {"ls": _ls, "verify": _verify, "inspect": _inspect, "export": _export}[args.verb](args)
    except (LookupError, IntegrityError, ValueError) as exc:
        print(f"phoenixft ckpt {args.verb}: error: {exc}", file=sys.stderr)
    except BrokenPipeError:
        raise  # (its reader stopped reading: cli.main ends quietly)
    except Exception as exc:  # noqa: BLE001 - storage errors (s3fs, botocore): one line
        print(f"phoenixft ckpt {args.verb}: error: {explain(args.url, exc)}", file=sys.stderr)
    return 2


def _ls(args) -> int:
    from phoenixft.checkpoint.manifests import scan
    from phoenixft.checkpoint.writer_lease import LEASE, describe, fresh
    tier = _tier(args.url)
    found = scan(tier)
    if not found.good and not found.bad:
        print(f"{args.url}: no committed checkpoint")
        return 0
    print(f"{'step':>8}  {'job':12}  {'ranks':>5}  {'gen':>4}  {'records':14}  {'bytes':>12}  time")
    for s in sorted([*found.good, *found.bad]):
        if s in found.bad:
            print(f"{s:>8}  UNREADABLE: {found.bad[s]}")
            continue
        m = found.good[s]
        kinds = "+".join(sorted({r["kind"] for r in m["records"]}))
        size = sum(r["nbytes"] for r in m["records"])
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m["time"]))
        print(f"{s:>8}  {m['job_id']:12}  {m['world_size']:>5}  {m['generation']:>4}  "
              f"{kinds:14}  {size:>12}  {when}")
    try:
        lease = json.loads(tier.read_object(LEASE))
        print(f"writer: {describe(lease)}{'' if fresh(lease) else ', stale'}")
    except (KeyError, ValueError):
        pass
    return 0


def _dcp_dirs(tier) -> list[str]:
    """The checkpoints in DCP's default format under a persist URL (`checkpoint/step-N`),
    or the URL itself when it is one."""
    if tier.fs.exists(f"{tier.root}/.metadata"):
        return [tier.url]
    found = tier.fs.glob(f"{tier.root}/checkpoint/step-*")
    return [f"{tier.url}/checkpoint/{p.rstrip('/').rsplit('/', 1)[-1]}" for p in sorted(found)]


def _verify_dcp(urls: list[str]) -> int:
    from phoenixft.checkpoint import dcp_checkpoint
    bad = 0
    for url in urls:
        problems = dcp_checkpoint.verify(url)
        bad += len(problems)
        print(f"{url}: " + ("ok" if not problems else "BAD: " + "; ".join(problems)))
    return bad


def _verify(args) -> int:
    from phoenixft.checkpoint.export import read_fixed
    from phoenixft.checkpoint.integrity import IntegrityError
    from phoenixft.checkpoint.manifests import scan
    tier = _tier(args.url)
    dcp_dirs = _dcp_dirs(tier) if args.step is None else []
    if dcp_dirs and not tier.manifests():  # (a DCP checkpoint alone: torchtitan's, an export)
        return 1 if _verify_dcp(dcp_dirs) else 0
    steps = [_step(tier, args.step)] if args.step is not None else tier.manifests()
    if not steps:
        raise LookupError(f"{tier.url} holds no committed checkpoint (no manifest)")
    found = scan(tier, steps)
    bad, fixed = len(found.bad), {}
    for s in steps:
        if s in found.bad:
            print(f"step {s}: BAD manifest: {found.bad[s]}")
            continue
        m = found.good[s]
        for r in range(m["world_size"]):
            try:
                tier.get(s, r, m)
                print(f"step {s} rank {r}: ok")
            except (IntegrityError, KeyError) as exc:
                bad += 1
                print(f"step {s} rank {r}: BAD: {exc}")
        key = (m["model"].get("fixed"), m["model"].get("fixed_checksum"))
        if key[0] and key not in fixed:
            try:
                read_fixed(tier, m)
                fixed[key] = "ok"
            except IntegrityError as exc:
                fixed[key] = f"BAD: {exc}"
                bad += 1
            print(f"step {s} model tensors {key[0]}: {fixed[key]}")
    bad += _verify_dcp(dcp_dirs)
    print(f"{args.url}: {len(steps)} committed step(s), {bad} bad (record(s), manifest(s) "
          "or model file(s))")
    return 1 if bad else 0
def _inspect(args) -> int:
    from phoenixft.checkpoint.slots import blob_snapshot
    tier = _tier(args.url)
    s = _step(tier, args.step)
    m = tier.read_manifest(s)
    print(json.dumps({k: v for k, v in m.items() if k != "model"}, indent=1))
    meta = m["model"]["meta"]
    for url in _dcp_dirs(tier):
        print(f"in torch.distributed.checkpoint's default format: {url} "
              "(dcp.load(state, checkpoint_id=...) reads it, or --init-from)")
    trained = len(meta["params"]) if "params" in meta else f"{meta.get('layout')} sharded"
    print(f"model: {trained} trainable tensors, {meta['numel']} parameters "
          f"({meta['dtype']}), config: {'yes' if meta.get('config') else 'none'}, "
          f"untrained tensors: {m['model'].get('fixed')}")
    snap = blob_snapshot(tier.get(s, 0, m), s)
    print(f"rank 0 snapshot: {snap.header.data_nbytes} bytes of state")
    for name, t in snap.tensors.items():
        print(f"  {name:40} {str(t.dtype):16} {list(t.shape)}")
    return 0


def _export(args) -> int:
    from phoenixft.checkpoint.export import check_target, export_dcp, export_hf
    check_target(args.to, args.force)
    tier = _tier(args.url)
    s = _step(tier, args.step)
    if args.format == "dcp":
        out = export_dcp(tier, s, args.to)
        print(f"wrote step {s} of {args.url} to {out} (DCP's default format: .metadata, "
              "*.distcp; model, optimizer and train_state.step)")
        return 0
    out = export_hf(tier, s, args.to)
    print(f"wrote step {s} of {args.url} to {out} (config.json, model.safetensors)")
    return 0
