"""`phoenixft bench torchft --hsdp S`: the HSDP case, 2 replica groups of S FSDP2 ranks.

Same model (examples/train_fsdp.py's), same microbatches (one per rank and step, M = 2S),
1 torch thread per process, side by side in one process tree:
- plain torchrun on the same (2, S) HSDP mesh (torchrun_fsdp_baseline.py, no checkpoint),
  failure-free: the step time both are compared with;
- phoenixft: `--dp-shard S`, no spare, `--min-nproc S --respawn S`: the SIGKILLed rank's
  group leaves, the other takes its microbatches, the respawned group comes back at a
  step boundary, healed from the surviving group's memory;
- torchft 0.2.0: one torchrun per group (torchft_hsdp_job.py: FSDP2 in the group, the
  cross-group mean through FSDP2's all-reduce hook over torchft's managed process group,
  as torchtitan does), the same rank SIGKILLed at the same step, its group restarted at
  once by this process.
The figures are `bench torchft`'s: kill -> the survivor's next committed step, kill ->
back to full strength, updates thrown away, microbatches not trained on.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from phoenixft.bench.goodput_jobs import TorchrunJob, Workload
from phoenixft.bench.harness import FSDP, FSDP_BASELINE, run_job
from phoenixft.bench.recovery import measure_events
from phoenixft.bench.torchft_figures import plain_step_s, run_pair, torchft_fault
from phoenixft.bench.torchft_run import TorchftHsdpRun


def _plain_step_s(root: Path, args: argparse.Namespace, work: Workload) -> float:
    """Plain torchrun on the HSDP mesh, failure-free: its median step."""
    return plain_step_s(TorchrunJob(run_dir=root / "torchrun-hsdp", work=work, max_restarts=0,
                                    ckpt_every=10**9, script=FSDP_BASELINE, ckpt="dcp",
                                    script_extra=["--dp-shard", str(args.hsdp)]),
                        "plain torchrun HSDP")


def phoenix_hsdp_fault(job: dict, run_dir: Path, world: int, m: int) -> dict:
    """The kill's figures from phoenixft's events; full strength is the first step with
    every group back; microbatches not trained are counted from audit.jsonl."""
    events = job["events"]
    ev = measure_events(events)
    inject = next(e for e in events if e["event"] == "inject")
    back = next((e for e in events if e["event"] == "step" and e["t"] > inject["t"]
                 and e.get("world_size") == world and e.get("gen", 0) > inject.get("gen", 0)),
                None)
    audit = [json.loads(x) for x in (run_dir / "audit.jsonl").read_text().splitlines()]
    rec = next(e for e in events if e["event"] == "recovered")
    # a respawned worker that registered before the leader decided is a spare: the dead
    # rank is swapped inside its group, and no group leaves
    how = ("swapped inside its group (a respawned worker was ready)"
           if rec.get("world_size") == world else "its group left, then came back")
    return {"how": how, "kill_to_survivor_step_s": ev["kill_to_next_step_s"],
            "kill_to_full_strength_s": round(back["t"] - inject["t"], 4) if back else None,
            "restart_to_ready_s": None,  # respawned by the agent, admitted when registered
            "detect_s": ev["detect_s"], "recover_s": ev["recover_s"],
            "lost_steps": ev["lost_steps"], "steps_short_of_data": sum(
                len(set(a["microbatches"])) < m for a in audit),
            "microbatches_not_trained": sum(m - len(set(a["microbatches"])) for a in audit)}


def runs(args: argparse.Namespace, root: Path) -> dict:
    """Plain torchrun, then both systems with the same SIGKILL (the last rank of group 1
    at --kill-step); the step times are the steps before the kill (--no-free-runs) or
    failure-free runs of both."""
    s = args.hsdp
    world, m = 2 * s, 2 * s
    work = Workload(preset=args.preset, steps=args.steps, microbatches=m, nproc=world)
    plain = _plain_step_s(root, args, work)

    def phoenix(name: str, inject: list[str]) -> dict:
        return run_job(root / name, nproc=world, min_nproc=s, respawn=s, inject=inject,
                       timeouts={"heartbeat_timeout_s": args.heartbeat_timeout},
                       script=str(FSDP), script_args=[
                           "--steps", str(args.steps), "--preset", args.preset, "--threads",
                           "1", "--dp-shard", str(s), "--microbatches", str(m)])

    def torchft(name: str, kill: int | None) -> TorchftHsdpRun:
        run = TorchftHsdpRun(args.python, root / name,
                             Workload(preset=args.preset, steps=args.steps, microbatches=m,
                                      nproc=2), shard=s, kill_step=kill,
                             heartbeat_timeout_s=args.heartbeat_timeout)
        run.events = run.run()
        return run

    px_step, tf_step, px_kill, tf_kill = run_pair(args, phoenix, torchft, kill_rank=world - 1,
                                                  label=" HSDP")
    return {"layout": f"hsdp 2x{s}", "microbatches": m, "ddp_step_s": round(plain, 4),
            "reference": f"plain torchrun, FSDP2 HSDP (2, {s}) mesh",
            "processes": f"2 groups x {s} ranks x 1 torch thread each (+ {s} respawned for "
                         "phoenixft, + a restarted group and a lighthouse for torchft)",
            "rows": {
                "phoenixft": {"step_s": round(px_step, 4),
                              "step_ratio_vs_ddp": round(px_step / plain, 4),
                              **phoenix_hsdp_fault(px_kill, root / "phoenixft-hsdp-kill",
                                                   world, m)},
                "torchft": {"step_s": round(tf_step, 4),
                            "step_ratio_vs_ddp": round(tf_step / plain, 4),
                            **torchft_fault(tf_kill.events, tf_kill.restarts, m)}}}
