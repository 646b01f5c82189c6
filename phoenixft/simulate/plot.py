"""The projection as a picture: effective throughput against GPUs, one line a strategy,
one panel a failure rate (matplotlib, written to a PNG)."""

from __future__ import annotations

from pathlib import Path

from phoenixft.simulate.model import STRATEGIES

LABELS = {"restart": "checkpoint-restart", "spares": "phoenixft spares",
          "recover": "ReCoVer (no spares)", "tiers": "spares + tiers",
          "hsdp": "HSDP replica groups"}


def plot(rows: list[dict], path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = list(dict.fromkeys(r["rate"] for r in rows))
    fig, axes = plt.subplots(1, len(rates), figsize=(6 * len(rates), 4.2), squeeze=False)
    for ax, rate in zip(axes[0], rates):
        mine = sorted((r for r in rows if r["rate"] == rate), key=lambda r: r["gpus"])
        for st in STRATEGIES:
            ax.plot([r["gpus"] for r in mine], [r[st] for r in mine], marker="o",
                    label=LABELS[st])
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 1.02)
        ax.axhline(0.9, color="grey", lw=0.5, ls=":")
        ax.set_xlabel("GPUs")
        ax.set_ylabel("effective throughput (failure-free = 1)")
        ax.set_title(f"failure rate: {rate}")
        ax.grid(alpha=0.3)
    axes[0][0].legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
