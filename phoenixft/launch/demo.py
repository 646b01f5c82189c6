"""`phoenixft demo`: 4 workers + 1 warm spare train the example model; one worker is
SIGKILLed mid-run; the spare takes its rank and training goes on. Then the same job runs
without failures and the two final states are compared bit for bit."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table

from phoenixft.observe.console import RunView

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"


def _launch(run_dir: Path, steps: int, preset: str, extra: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "phoenixft.cli", "run", "--quiet", "--run-dir", str(run_dir),
           *extra, str(EXAMPLE), "--steps", str(steps), "--preset", preset]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _watch(console: Console, proc: subprocess.Popen, view: RunView) -> tuple[int, str]:
    with Live(view.render(), console=console, refresh_per_second=4, transient=False) as live:
        while proc.poll() is None:
            live.update(view.render())
            time.sleep(0.25)  # UI refresh period, not synchronisation
        live.update(view.render())
    console.print()
    return proc.returncode, proc.stderr.read() if proc.stderr else ""


def cmd_demo(args) -> int:
    console = Console()
    if not EXAMPLE.exists():
        console.print(f"[red]phoenixft demo needs the source tree: {EXAMPLE} is missing[/]")
        return 2
    steps = args.steps or 80
    kill_at = max(2, int(steps * 0.4))
    root = Path(args.run_dir)
    shutil.rmtree(root, ignore_errors=True)
    faulty, reference = root / "with-failure", root / "failure-free"
    preset = "small"
    console.print(f"[bold]phoenixft demo[/]: Llama-style model ({preset} preset) on the Python "
                  f"standard library, 4 workers + 1 warm spare, 1 torch thread each; rank 2 is "
                  f"SIGKILLed at step {kill_at}.")
    t0 = time.time()
    rc, err = _watch(console, _launch(faulty, steps, preset,
                                      ["--nproc", "4", "--spares", "1",
                                       "--inject", f"kill:rank=2:step={kill_at}"]),
                     RunView(faulty, steps, "with a failure"))
    if rc != 0:
        console.print(f"[red]the job failed (exit {rc})[/]\n{err}")
        return rc
    console.print("Now the same job without failures, to compare final states:")
    rc, err = _watch(console, _launch(reference, steps, preset, ["--nproc", "4"]),
                     RunView(reference, steps, "failure-free reference"))
    if rc != 0:
        console.print(f"[red]the reference job failed (exit {rc})[/]\n{err}")
        return rc
    a = json.loads((faulty / "summary.json").read_text())
    b = json.loads((reference / "summary.json").read_text())
    table = Table(title="phoenixft demo summary")
    table.add_column("")
    table.add_column("with failure")
    table.add_column("failure-free")
    table.add_row("steps", str(a["final_step"]), str(b["final_step"]))
    table.add_row("failures", str(len(a["failures"])), str(len(b["failures"])))
    for r in a["recoveries"]:
        table.add_row(f"rank {r['rank']} ({r['kind']}): detect / recover",
                      f"{r['detect_s']:.3f} s / {r['recover_s']:.3f} s", "")
        table.add_row("  lost steps, restored from", f"{r['lost_steps']}, {r['source']}", "")
    table.add_row("wall time", f"{a['wall_s']:.1f} s", f"{b['wall_s']:.1f} s")
    table.add_row("final loss", f"{a['final_loss']:.4f}", f"{b['final_loss']:.4f}")
    same = a["final_state_digest"] == b["final_state_digest"]
    table.add_row("final state digest", a["final_state_digest"][:16], b["final_state_digest"][:16])
    table.add_row("identical final state", "[green]yes[/]" if same else "[red]NO[/]", "")
    console.print(table)
    console.print(f"Run directories: {faulty} and {reference} (events.jsonl, status.json, "
                  f"summary.json, model/). Total {time.time() - t0:.0f} s.")
    return 0 if same else 1
