"""`phoenixft plot RUN_DIR [-o FILE]`: a PNG timeline of a run from its event log.

Training: throughput and loss against wall time. Throughput is each step's own rate
(1 / the time since the step before), held over the interval it took, so a recovery's gap
shows as a dip exactly where it happened (a sliding window spread a 0.04 s recovery over
five steps and bottomed out after it). Each failure is a red line labelled with its worker
and kind; each recovery a green span from the failure's detection to the first step after
it, labelled with where the state came from (local snapshot, peer replica, persistent
storage) and how long it took. Serving: the engine's crashes and the takeovers that resumed its requests.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from phoenixft.observe.events import read_events
from phoenixft.observe.story import plural


def _sources(run_dir: Path) -> dict[int, str]:
    try:
        s = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return {}
    return {r["gen"]: r.get("source") or "?" for r in s.get("recoveries", [])}


def step_rates(steps: list[dict]) -> tuple[list[float], list[float]]:
    """(times, rates): for each completed step after the first, the time it completed and
    1 / its interval, to be drawn held over that interval (`drawstyle="steps-pre"`)."""
    xs, ys = [], []
    for prev, cur in zip(steps, steps[1:]):
        dt = cur["t"] - prev["t"]
        if dt > 0:
            xs.append(cur["t"])
            ys.append(1.0 / dt)
    return xs, ys


def recovery_spans(events: list[dict]) -> list[tuple[float, float, dict]]:
    """(from, to, recovered event) per recovery: from the detection of the failure that
    started it (the newest failure event before it) to the first step completed after it."""
    out, failed_at = [], None
    events = sorted(events, key=lambda e: e["t"])  # several processes append to the log
    for i, e in enumerate(events):
        if e["event"] == "failure":
            failed_at = e["t"] if failed_at is None else failed_at
        elif e["event"] == "recovered":
            after = next((x["t"] for x in events[i + 1:] if x["event"] == "step"), e["t"])
            out.append((failed_at if failed_at is not None else e["t"], after, e))
            failed_at = None
    return out


def plot_training(run_dir: Path, events: list[dict], out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = sorted((e for e in events if e["event"] == "step"), key=lambda e: e["t"])
    t0 = min(e["t"] for e in events)
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(11, 6), sharex=True,
                                  gridspec_kw={"height_ratios": [2, 1]})
    xs, ys = step_rates(steps)
    ax.plot([x - t0 for x in xs], ys, color="tab:blue", lw=1, drawstyle="steps-pre")
    ax.set_ylabel("steps / s (each step)")
    ax2.plot([e["t"] - t0 for e in steps], [e["loss"] for e in steps], color="tab:gray", lw=1)
    ax2.set_ylabel("loss")
    ax2.set_xlabel("wall time since the job started (s)")
    sources = _sources(run_dir)
    # the top from the 98th percentile: two steps logged a few us apart would flatten the rest
    ax.set_ylim(0, 1.15 * sorted(ys)[int(0.98 * (len(ys) - 1))] if ys else 1.0)
    for e in events:
        x = e["t"] - t0
        if e["event"] == "failure":
            for a in (ax, ax2):
                a.axvline(x, color="tab:red", lw=1, ls="--")
            ax.text(x, 0.98, f" {e.get('wid')} {e.get('kind')}", color="tab:red", fontsize=8,
                    rotation=90, va="top", transform=ax.get_xaxis_transform())
    for start, end, e in recovery_spans(events):
        for a in (ax, ax2):
            a.axvspan(start - t0, end - t0, color="tab:green", alpha=0.25, lw=0)
        ax.text(end - t0, 0.02, f" gen {e['gen']}: {sources.get(e['gen'], '?')}, "
                f"{e.get('recover_s', 0):.2f} s", color="tab:green", fontsize=8,
                rotation=90, va="bottom", transform=ax.get_xaxis_transform())
    n_fail = sum(1 for e in events if e["event"] == "failure")
    ax.set_title(f"{run_dir}: {plural(len(steps), 'step')}, {plural(n_fail, 'failure')} "
                 "(red: failure; green: detection to the next step, with the restore source)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_serving(run_dir: Path, events: list[dict], out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min(e["t"] for e in events)
    fig, ax = plt.subplots(figsize=(11, 3.5))
    ready = [e for e in events if e["event"] == "engine_ready"]
    ax.bar([e["t"] - t0 for e in ready], [e.get("resumed", 0) for e in ready], width=0.4,
           color="tab:green", label="requests resumed by the new engine")
    for e in events:
        if e["event"] in ("engine_crash", "engine_lost"):
            ax.axvline(e["t"] - t0, color="tab:red", ls="--", lw=1)
    ax.set_xlabel("wall time since the server started (s)")
    ax.set_ylabel("requests resumed")
    ax.set_title(f"{run_dir}: {len(ready)} engine takeovers (red: an engine died)")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def register(sub) -> None:
    p = sub.add_parser("plot", help="a PNG timeline of a run: throughput over time, "
                                    "failures and recoveries marked")
    p.add_argument("run_dir", nargs="?", default="runs/latest")
    p.add_argument("-o", "--out", default=None, help="PNG file (default RUN_DIR/timeline.png)")
    p.set_defaults(func=cmd_plot)


def cmd_plot(args) -> int:
    run_dir = Path(args.run_dir)
    events = list(read_events(run_dir / "events.jsonl"))
    if not events:
        print(f"phoenixft plot: no events in {run_dir / 'events.jsonl'}", file=sys.stderr)
        return 2
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("phoenixft plot needs matplotlib: pip install 'phoenixft[plot]'", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else run_dir / "timeline.png"
    if any(e["event"] == "step" for e in events):
        plot_training(run_dir, events, out)
    else:
        plot_serving(run_dir, events, out)
    print(f"wrote {out}")
    return 0
