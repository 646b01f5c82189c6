"""BENCHMARKS.md from a `bench all` report: the headline table (one line per benchmark,
its goals met), then per benchmark its command, its goals and its own tables. Reads only
the report dict, so the file can be rebuilt from the JSON beside it."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def machine() -> str:
    """The machine in words: cores, CPU model, kernel, GPU or not."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()} CPU cores ({model}), Linux {platform.release()}, no GPU" \
        if not _has_cuda() else f"{os.cpu_count()} CPU cores ({model}) + CUDA GPU"


def _has_cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


def render(report: dict) -> str:
    lines = ["# Benchmarks", "",
             f"`phoenixft bench all{' --quick' if report['quick'] else ''}` on "
             f"{report['machine']}; {report['wall_s'] / 60:.1f} minutes in all. Every figure "
             "is a ratio against the alternative run in the same invocation, or a time "
             "measured here; the JSON beside this file has every number.", "",
             "| benchmark | headline | goals met |", "|---|---|---|"]
    for name, b in report["benchmarks"].items():
        met = sum(g["met"] for g in b["goals"])
        lines.append(f"| {name} | {b['headline']} | {met}/{len(b['goals'])} |")
    for name, b in report["benchmarks"].items():
        lines += ["", f"## {name}", "", f"`{b['command']}` ({b['processes']}; "
                  f"{b['wall_s']:.0f} s, exit {b['rc']})", ""]
        if b["goals"]:
            lines += ["| goal | target | measured | met |", "|---|---|---|---|"]
            lines += [f"| {g['name']} | {g['goal']} | {g['measured']} | "
                      f"{'yes' if g['met'] else '**no**'} |" for g in b["goals"]]
        extra = b.get("table")
        if extra:
            lines += [""] + extra
    return "\n".join(lines) + "\n"
