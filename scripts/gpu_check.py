"""The checks `scripts/gpu-check` runs: phoenixft's GPU paths on one GPU, in under 8 minutes.

1. hot-swap with NCCL: 1 worker + 1 warm spare on the GPU, the worker SIGKILLed mid-run;
   the spare takes its rank from the snapshot and the job ends with the losses of a
   failure-free run of the same job (the final digest is reported: CUDA kernels with
   atomics need not be bitwise reproducible).
2. the same with an FSDP2 model (examples/train_fsdp.py on a one-rank mesh, killed before
   its optimizer step).
3. snapshot overhead with CUDA streams: `phoenixft bench overhead --device cuda`, one run
   whose snapshots alternate on/off in blocks (device-to-host copies on a side stream into
   page-locked shared memory).
4. the serving engine on CUDA against transformers on the same random Llama: logits of
   every generated token within tolerance, greedy tokens equal.
5. shrink: whether the GPU's NCCL backend shrinks a communicator in place (reported only:
   a shrink needs two ranks, and NCCL takes one rank per GPU).

No pipeline case: a pipeline's stages are at least two ranks of one communicator, which
NCCL refuses on one GPU (the FSDP2 case above runs its mesh on one rank for the same
reason). The pipeline's own parts are the HSDP layout's groups plus torch's schedule;
on one GPU they would run only over gloo, which is what CI already runs.

`--device cpu` runs the same checks on the CPU (gloo), to try the script itself on a
machine without a GPU. Writes report.json to $OUT (or runs/gpu-check); exit 0 only when
every check passed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHOENIXFT = [sys.executable, "-m", "phoenixft.cli"]


def sh(cmd: list[str], timeout: float, out: Path) -> tuple[int, float]:
    """Run `cmd` from the repository root with its output in `out`; (exit status, wall s)."""
    t0 = time.time()
    with out.open("w") as log:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, time.time() - t0


def tail(path: Path, n: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:])


def hotswap(args, out: Path) -> dict:
    return _swap_pair(args, out, ["examples/train_gpt.py", "--preset", "small"],
                      f"kill:rank=0:step={args.steps // 2}")


def fsdp(args, out: Path) -> dict:
    """The FSDP2 model of examples/train_fsdp.py (fully_shard over a one-rank mesh: NCCL
    refuses two ranks of one communicator on one GPU), killed before its optimizer step;
    its mesh's SwapGroup puts the new generation's NCCL communicator under FSDP2. (FSDP2
    on one rank issues no reduce-scatter, so phase=backward would never fire.)"""
    return _swap_pair(args, out, ["examples/train_fsdp.py", "--preset", "small"],
                      f"kill:rank=0:step={args.steps // 2}:phase=update")


def _swap_pair(args, out: Path, script: list[str], kill: str) -> dict:
    """A failure-free run of `script` and one whose worker `kill` hits, 1 worker + 1 spare."""
    job = [*script, "--device", args.device, "--steps", str(args.steps)]
    runs = {}
    for name, extra in (("failure-free", []), ("hot-swap", ["--spares", "1", "--inject", kill])):
        d = out / name
        rc, wall = sh([*PHOENIXFT, "run", "--run-dir", str(d), "--nproc", "1", "--quiet", *extra,
                       *job], 240, out / f"{name}.log")
        if rc != 0 or not (d / "summary.json").exists():
            return {"ok": False, "error": f"{name} run: exit {rc}\n{tail(out / f'{name}.log')}"}
        s = json.loads((d / "summary.json").read_text())
        ev = [json.loads(line) for line in (d / "events.jsonl").read_text().splitlines()]
        s["backends"] = sorted({e.get("backend", "?") for e in ev if e["event"] == "joined"})
        s["wall_s"] = wall
        runs[name] = s
    ref, got = runs["failure-free"], runs["hot-swap"]
    worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got["losses"], ref["losses"]))
    rec = got["recoveries"][0] if got["recoveries"] else {}
    want_backend = "nccl" if args.device == "cuda" else "gloo"
    ok = (len(got["failures"]) == 1 and got["final_step"] == args.steps and worst <= 1e-3
          and got["backends"] == [want_backend])
    return {"ok": ok, "failures": len(got["failures"]), "backends": got["backends"],
            "max_loss_rel_diff": worst, "same_digest": got["final_state_digest"] ==
            ref["final_state_digest"], "detect_s": rec.get("detect_s"),
            "recover_s": rec.get("recover_s"), "restore_source": rec.get("source"),
            "wall_s": {k: round(v["wall_s"], 1) for k, v in runs.items()}}


def overhead(args, out: Path) -> dict:
    report = out / "overhead.json"
    rc, wall = sh([*PHOENIXFT, "bench", "overhead", "--device", args.device, "--nproc", "1",
                   "--pairs", "1", "--steps", "30", "--block", "2", "--blocks", "12",
                   "--out", str(report)], 300, out / "overhead.log")
    if rc != 0 or not report.exists():
        return {"ok": False, "error": f"exit {rc}\n{tail(out / 'overhead.log')}"}
    r = json.loads(report.read_text())
    inside = r["in_run"]
    return {"ok": math.isfinite(inside["ratio"]) and len(inside["pair_ratios"]) > 0,
            "in_run_ratio_on_off": inside["ratio"], "pair_ratios": inside["pair_ratios"],
            "median_step_on_s": inside["median_step_on_s"],
            "median_step_off_s": inside["median_step_off_s"],
            "in_run_se": inside["se"],
            "snapshot_thread_cpu_s_per_snapshot": inside["thread_cpu_s_per_snapshot"],
            "across_runs_ratio": r["ratio"], "same_final_state": r["same_final_state"],
            "wall_s": round(wall, 1)}


ENGINE = """
import json, sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
from phoenixft.serve import LLM, SamplingParams
device, path = sys.argv[1], sys.argv[2]
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
ref = LlamaForCausalLM(cfg).float().eval()
with torch.no_grad():  # init leaves norms at 1: perturb so a wrong norm would show
    for p in ref.parameters():
        p.add_(torch.randn_like(p) * 0.02)
ref.save_pretrained(path, safe_serialization=True)
ref = ref.to(device)
prompts = [list(range(3, 40)), [7] * 5 + list(range(100, 180)), [11, 12, 13], list(range(200, 460))]
llm = LLM(path, device=device, block_size=16, max_model_len=512)
outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0), keep_logits=True)
worst, same = 0.0, True
for p, o in zip(prompts, outs):
    with torch.no_grad():
        full = torch.tensor([p + o.token_ids], device=device)
        want = ref(full).logits[0, len(p) - 1:-1].float().cpu()
        g = ref.generate(torch.tensor([p], device=device), max_new_tokens=24, do_sample=False,
                         pad_token_id=0)
    worst = max(worst, (torch.stack(o.logits).float() - want).abs().max().item())
    same = same and o.token_ids == g[0, len(p):].tolist()
print(json.dumps({"max_abs_logit_diff": worst, "greedy_tokens_equal": same,
                  "kv_cache_device": str(llm.engine.runner.k_cache.device)}))
"""


def engine(args, out: Path) -> dict:
    script = out / "engine_check.py"
    script.write_text(ENGINE)
    rc, wall = sh([sys.executable, str(script), args.device, str(out / "model")], 300,
                  out / "engine.log")
    if rc != 0:
        return {"ok": False, "error": f"exit {rc}\n{tail(out / 'engine.log')}"}
    r = json.loads((out / "engine.log").read_text().splitlines()[-1])
    r["ok"] = r["greedy_tokens_equal"] and r["max_abs_logit_diff"] <= 1e-3 and \
        r["kv_cache_device"].startswith(args.device)
    r["wall_s"] = round(wall, 1)
    return r


def shrink(args, out: Path) -> dict:
    """Whether the GPU's NCCL backend shrinks a communicator in place (ncclCommShrink,
    NCCL >= 2.27), which a recovery uses when ranks leave without a replacement
    (train/kept_groups.py). One GPU cannot show a shrink itself: NCCL refuses two ranks
    of one communicator on one device. On the CPU: gloo, which never shrinks."""
    import torch
    import torch.distributed as dist

    from phoenixft.train.kept_groups import can_shrink
    if args.device == "cuda":
        pg = dist.ProcessGroupNCCL(dist.HashStore(), 0, 1)
        version = ".".join(map(str, torch.cuda.nccl.version()))
    else:
        pg = dist.ProcessGroupGloo(dist.HashStore(), 0, 1)
        version = None
    supported = can_shrink(pg)
    return {"ok": True, "backend": pg.name(), "nccl_version": version,
            "supports_shrinking": supported,
            "note": "reported, not exercised: a shrink needs 2 ranks, NCCL 1 per GPU"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--only", action="append",
                    choices=["hotswap", "fsdp", "overhead", "engine", "shrink"])
    args = ap.parse_args()
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            print("gpu-check: no CUDA device visible (torch.cuda.is_available() is False); "
                  "--device cpu tries the script on the CPU", file=sys.stderr)
            return 2
        print(f"gpu-check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
              f"CUDA {torch.version.cuda}", flush=True)
    out = Path(os.environ.get("OUT") or ROOT / "runs" / "gpu-check")
    out.mkdir(parents=True, exist_ok=True)
    report, t0 = {"device": args.device}, time.time()
    for name, check in (("hotswap", hotswap), ("fsdp", fsdp), ("overhead", overhead),
                        ("engine", engine), ("shrink", shrink)):
        if args.only and name not in args.only:
            continue
        (out / name).mkdir(exist_ok=True)
        try:
            report[name] = check(args, out / name)
        except Exception as exc:  # noqa: BLE001 - one check's crash is its failure
            report[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        print(f"{name}: {json.dumps(report[name], indent=None)[:1500]}", flush=True)
    report["wall_s"] = round(time.time() - t0, 1)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    ok = all(v["ok"] for v in report.values() if isinstance(v, dict))
    print(f"gpu-check: {'all checks passed' if ok else 'FAILED'} in {report['wall_s']} s; "
          f"report {out / 'report.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
