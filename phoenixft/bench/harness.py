"""Run whole jobs for benchmarks, each in its own process tree, and read what they left.

`python -m phoenixft.bench.harness CONFIG_JSON` runs one agent with an `AgentConfig`
given as JSON: benchmarks reach settings (snapshots off, say) that the CLI does not
expose on purpose.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

from phoenixft.observe.events import read_events

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_gpt.py"
FSDP = ROOT / "examples" / "train_fsdp.py"  # the FSDP2 / HSDP example
FSDP_BASELINE = Path(__file__).with_name("torchrun_fsdp_baseline.py")  # its torchrun twin


def run_job(run_dir: Path, timeout_s: float = 1800, **agent_cfg) -> dict:
    """Run one job to completion; returns its summary.json (plus its events).
    `agent_cfg` is AgentConfig's tree as plain data (branches as dicts, e.g.
    `snapshots={"enabled": False}`), `inject` a list of fault specs."""
    agent_cfg.setdefault("script", str(EXAMPLE))
    agent_cfg.update(run_dir=str(run_dir), echo=False)
    inject = agent_cfg.pop("inject", [])
    payload = json.dumps({"cfg": agent_cfg, "inject": inject})
    proc = subprocess.run([sys.executable, "-m", "phoenixft.bench.harness", payload],
                          capture_output=True, text=True, timeout=timeout_s)
    summary_path = Path(run_dir) / "summary.json"
    if proc.returncode != 0 or not summary_path.exists():
        raise RuntimeError(f"benchmark job in {run_dir} failed (exit {proc.returncode}):\n"
                           f"{proc.stderr[-2000:]}")
    summary = json.loads(summary_path.read_text())
    summary["events"] = list(read_events(Path(run_dir) / "events.jsonl"))
    return summary


def median(xs: list[float]) -> float:
    """The median, NaN for none (a run that timed no step shows as such, not as an error)."""
    return statistics.median(xs) if xs else float("nan")


def _main() -> int:
    from phoenixft.config import build
    from phoenixft.faults.inject import parse_spec
    from phoenixft.launch.agent import Agent, AgentConfig

    data = json.loads(sys.argv[1])
    cfg = build(AgentConfig, {**data["cfg"], "inject": [parse_spec(s) for s in data["inject"]]})
    return Agent(cfg).run()


if __name__ == "__main__":
    sys.exit(_main())

