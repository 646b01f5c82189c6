"""Published failure rates and the mix of failure kinds the simulator draws from (the
sources beside each figure), kept apart from the model so a new source is one line."""

from __future__ import annotations

HOUR = 3600.0
# per-GPU failure rates (failures per GPU-hour), from published data
RATES = {
    # Llama 3 pre-training: 419 unexpected interruptions in 54 days on 16,384 H100s
    "llama3": 419 / (54 * 24 * 16384),
    # Meta's research clusters: ~6.5 failures per 1,000 node-days (8 GPUs per node)
    "rsc": 6.5 / (1000 * 24 * 8),
    # the projection the issue cites: MTTF 7.9 h at 1,024 GPUs (-> ~14 min at 131k)
    "projected": 1 / (7.9 * 1024),
}
# Llama 3's mix: 58.7% GPU related; the rest host (memory, host, software) and network
MIX = {"gpu": 0.587, "host": 0.373, "network": 0.04}


def parse_rates(text: str) -> dict[str, float]:
    """Comma-separated presets (`RATES`) or numbers per GPU-hour, by name."""
    out = {}
    for part in text.split(","):
        part = part.strip()
        if part in RATES:
            out[part] = RATES[part]
        else:
            try:
                out[part] = float(part)
            except ValueError:
                raise SystemExit(f"phoenixft simulate: unknown rate {part!r}; presets: "
                                 f"{', '.join(RATES)} or a number per GPU-hour") from None
    return out
