"""Table and plot for `phoenixft bench goodput` (reads only the result dict it wrote)."""

from __future__ import annotations

import statistics
from pathlib import Path

from rich.console import Console
from rich.table import Table

COLORS = {"clean": "tab:gray", "spares": "tab:blue", "shrink": "tab:green",
          "restart": "tab:red", "restart-clean": "tab:orange"}


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _schedule(result: dict) -> str:
    if result.get("fault_steps"):
        return f"SIGKILL at steps {', '.join(map(str, result['fault_steps']))}"
    return (f"SIGKILL every {result['interval_s']:.1f} s"
            f"{' (auto)' if result.get('interval_auto') else ''}")


def print_table(result: dict) -> None:
    console = Console(width=max(Console().width, 170))
    table = Table(title=(
        f"goodput ({result.get('layout', 'dp')}): {result['preset']} preset, "
        f"{result['steps']} steps x {result['microbatches']} "
        f"microbatches ({result['tokens_per_step']} tokens/step); each mode: 1 launcher process "
        f"+ worker processes x 1 torch thread, on {result['cpu_count']} cores; "
        f"{_schedule(result)}, "
        f"{result['failures']} failures; torchrun saves every {result['ckpt_every']} steps"))
    for col in ("mode", "worker processes", "workers start->end (mean)", "failures", "wall s",
                "steps", "eff steps/s", "tokens/s", "vs ckpt+restart", "vs failure-free x workers",
                "kill->next step s (median)", "steps redone", "load 1m"):
        table.add_column(col, overflow="fold", no_wrap=col == "mode")
    for r in result["modes"].values():
        gaps = r.get("kill_to_next_step_s") or []
        status = "" if r.get("completed") else (" TIMED OUT" if r["timed_out"] else f" rc {r['rc']}")
        table.add_row(
            r["label"], r["processes"],
            f"{r.get('workers_start', '-')}->{r.get('workers_end', '-')} "
            f"({_f(r.get('mean_workers'), '.2f')})",
            str(r["failures"]), _f(r.get("wall_s"), ".1f"),
            f"{r['final_step']}/{result['steps']}{status}",
            _f(r["eff_steps_s"], ".3f"), _f(r["tokens_s"], ",.0f"),
            _f(r.get("vs_restart"), ".2f") + "x" if r.get("vs_restart") else "-",
            _f(r.get("vs_clean_scaled"), ".2f") + "x" if r.get("vs_clean_scaled") else "-",
            _f(statistics.median(gaps), ".1f") if gaps else "-",
            str(r.get("steps_recomputed", "-")), _f(r.get("loadavg_1m"), ".1f"))
    console.print(table)
    console.print("wall s and eff steps/s: from the first completed step to the last (start-up "
                  "excluded, paid once per job); load average before/after "
                  f"{result['loadavg_before'][0]:.2f}/{result['loadavg_after'][0]:.2f} "
                  "(other processes on the machine skew the figures)")
    shrink = result["modes"].get("shrink", {})
    goals = result["goals"]
    if "vs_restart" in shrink:
        console.print(f"ReCoVer vs checkpoint-restart: {shrink['vs_restart']:.2f}x "
                      f"(goal >= {goals['shrink_vs_restart']}x)")
    if "vs_clean_scaled" in shrink:
        console.print(f"ReCoVer vs failure-free x mean surviving workers / {result['nproc']}: "
                      f"{shrink['vs_clean_scaled']:.2f}x (goal >= {goals['shrink_vs_clean_scaled']}x); "
                      f"scaled by the cores its workers could use, min(workers, "
                      f"{result['cpu_count']}): {shrink['vs_clean_scaled_by_cores']:.2f}x")
    for mode, r in result["modes"].items():
        if "restarts" in r:
            rs = r["restarts"]
            every = (f"{result['ckpt_every'] * r['median_step_s']:.1f} s"
                     if r.get("median_step_s") else "-")
            console.print(f"{mode}: checkpoint every {result['ckpt_every']} steps = {every} of "
                          f"training; restart attempts {rs['attempts']}, without a completed step "
                          f"{rs['attempts_without_a_step']}, resumed from steps {rs['resumed_from']}, "
                          f"'Connection refused' lines {rs['connection_refused_lines']}, "
                          f"timeout lines {rs['timeout_lines']}")


def _segments(pts: list[list]) -> list[list[list]]:
    """Split [t, step, workers, epoch] points where the epoch changes."""
    out: list[list[list]] = []
    for p in pts:
        if not out or out[-1][-1][3] != p[3]:
            out.append([])
        out[-1].append(p)
    return out


def plot_progress(result: dict, path: Path) -> None:
    """Completed step over wall time since launch, one line per mode, its kills as dashed
    vertical lines of the same colour; below it, the number of training workers."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, aw) = plt.subplots(2, 1, figsize=(10, 7), sharex=True,
                                 gridspec_kw={"height_ratios": [3, 1]})
    modes = list(result["modes"].items())
    for n, (mode, r) in enumerate(modes):
        pts = r["progress"]
        if not pts:
            continue
        c = COLORS.get(mode, "black")
        lift = (n - (len(modes) - 1) / 2) * 0.07  # keeps equal worker counts apart
        rate = f"{r['eff_steps_s']:.3f} steps/s" if r.get("eff_steps_s") else "no progress"
        # One segment per generation / restart attempt, so a restart shows as a gap.
        for i, seg in enumerate(_segments(pts)):
            t, s, w = [p[0] for p in seg], [p[1] for p in seg], [p[2] for p in seg]
            ax.plot(t, s, color=c, lw=1.6, marker="o" if len(seg) == 1 else None, ms=4,
                    label=f"{r['label']} ({rate})" if i == 0 else None)
            aw.step(t, [x + lift for x in w], where="post", color=c, lw=1.4)
        if not r.get("completed"):
            why = "timed out" if r["timed_out"] else f"exit {r['rc']}"
            ax.plot(pts[-1][0], pts[-1][1], "x", color=c, ms=10, mew=2)
            ax.annotate(f"job failed ({why})", (pts[-1][0], pts[-1][1]), color=c, fontsize=8,
                        xytext=(6, -12), textcoords="offset points")
        for i, k in enumerate(r["kills"]):
            ax.axvline(k["t_rel"], color=c, ls="--", lw=1, alpha=0.8,
                       label=f"SIGKILL, {r['label']}" if i == 0 else None)
    ax.set_ylabel("completed optimizer step")
    ax.set_title(f"goodput under SIGKILLs: {result['preset']} preset, {result['nproc']} workers, "
                 f"{result['microbatches']} microbatches/step, {_schedule(result)}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    aw.set_ylabel("training workers")
    aw.set_xlabel("wall time since launch (s)")
    aw.set_ylim(0, result["nproc"] + 0.5)
    aw.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
