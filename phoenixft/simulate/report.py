"""What `phoenixft simulate` reports from its result dict: its goals, its line in the
README's headline table, its tables for the console and for BENCHMARKS.md. Reads only
the result, so `bench all` renders a simulation it ran in another process the same way."""

from __future__ import annotations

from phoenixft.observe.goals import Goal
from phoenixft.simulate.model import STRATEGIES
from phoenixft.simulate.published import FT_HSDP_EFFECTIVE


def goals(result: dict) -> list[Goal]:
    """The projection at the sizes the issue names, and the validation's error per mode."""
    by = {(r["rate"], r["gpus"]): r for r in result["rows"]}
    out = []
    if ("llama3", 16384) in by:
        tiers = by["llama3", 16384]["tiers"]
        out.append(Goal("phoenixft + tiers at 16k GPUs, Llama 3 failure rate", ">= 0.97",
                        tiers, tiers >= 0.97))
    if ("projected", 100000) in by:
        tiers = by["projected", 100000]["tiers"]
        out.append(Goal("phoenixft + tiers at 100k GPUs, projected failure rate", ">= 0.9",
                        tiers, tiers >= 0.9))
    for c in result["validation"]:
        out.append(Goal(f"simulator predicts the {c['mode']} goodput ratio", "error <= 10%",
                        f"{100 * c['error']:.1f}%", c["error"] <= 0.1))
    for p in result.get("published", []):
        out.append(Goal(f"simulator, from its inputs: {p['point']}", p["published"],
                        f"{p['predicted']} {p['unit']}", p["within"]))
        if "ours" in p:
            out.append(Goal("phoenixft + tiers from FT-HSDP's inputs (its failure rate, "
                            "our costs at 100k GPUs)", f">= FT-HSDP's {FT_HSDP_EFFECTIVE}",
                            p["ours"], p["ours"] >= FT_HSDP_EFFECTIVE))
    return out


def headline(result: dict) -> str:
    """Tiers against restart at 16k (Llama 3's rate) and 100k GPUs (projected), and the
    validation's errors."""
    rows = {(r["rate"], r["gpus"]): r for r in result["rows"]}
    a, b = rows[("llama3", 16384)], rows[("projected", 100000)]
    errs = ", ".join(f"{v['mode']} {100 * v['error']:.0f}%" for v in result["validation"])
    return (f"phoenixft + tiers {a['tiers']:.3f} of failure-free at 16k GPUs (Llama 3 "
            f"rate; restart {a['restart']:.3f}), {b['tiers']:.3f} at 100k (projected; "
            f"restart {b['restart']:.3f}); validation error {errs}")


def markdown(result: dict) -> list[str]:
    """The projection table, the 2.23x crossover and the validation, as markdown lines."""
    rows = ["| rate | GPUs | job MTBF | restart | spares | ReCoVer | spares + tiers | "
            "HSDP groups | tiers / restart |", "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        rows.append(f"| {r['rate']} | {r['gpus']:,} | {r['mtbf_min']:.1f} min | "
                    f"{r['restart']:.3f} | {r['spares']:.3f} | {r['recover']:.3f} | "
                    f"{r['tiers']:.3f} | {r.get('hsdp', float('nan')):.3f} | "
                    f"{r['tiers_vs_restart']}x |")
    c = result["crossover_2_23x"]
    rows += ["", f"ReCoVer reaches {c['target_ratio']}x checkpoint-and-restart at "
             f"{c['gpus']:,} GPUs when the job's MTBF is {c['job_mtbf_min']:.1f} minutes "
             f"({c['per_gpu_hour']:.2e} failures per GPU-hour)."]
    if result.get("validation"):
        rows += ["", "| validation | predicted ratio | measured ratio | error |",
                 "|---|---|---|---|"]
        rows += [f"| {v['mode']} | {v['predicted_ratio']:.3f} | {v['measured_ratio']:.3f} | "
                 f"{100 * v['error']:.1f}% |" for v in result["validation"]]
    return rows + scale_markdown(result)


def scale_markdown(result: dict) -> list[str]:
    """The published points, a recovery's terms against the job's size, and the
    sensitivity tables."""
    rows: list[str] = []
    if result.get("published"):
        rows += ["", "| published point | reported | predicted from its inputs | within | "
                 "terms |", "|---|---|---|---|---|"]
        rows += [f"| {p['point']} | {p['published']} | {p['predicted']} {p['unit']} | "
                 f"{'yes' if p['within'] else 'no'} | "
                 f"{', '.join(f'{k} {v}' for k, v in p['terms'].items())}; {p['note']} |"
                 for p in result["published"]]
    if result.get("recovery_terms"):
        rows += ["", "| GPUs | detect s | control plane s | communicator s | state transfer s "
                 "| spare's recovery s | restart s |", "|---|---|---|---|---|---|---|"]
        for n, t in result["recovery_terms"].items():
            rec = t["detect"] + t["control"] + t["comm"] + t["transfer"]
            rows.append(f"| {int(n):,} | {t['detect']:.3f} | {t['control']:.3f} | "
                        f"{t['comm']:.1f} | {t['transfer']:.3f} | {rec:.1f} | "
                        f"{t['restart']:.0f} |")
    for sens in result.get("sensitivity", []):
        rows += ["", f"Sensitivity of spares + tiers at {sens['gpus']:,} GPUs ({sens['rate_name']} "
                 f"rate; projected {sens['effective']:.3f}): each input halved and doubled "
                 "(the exponent 0.2 either way), largest swing first.", "",
                 "| input | value | halved | doubled | swing |", "|---|---|---|---|---|"]
        rows += [f"| {r['input']} | {_v(r['value'])} | {r['halved']:.3f} | {r['doubled']:.3f} "
                 f"| {r['swing']:.3f} |" for r in sens["rows"][:10]]
        b = sens.get("budget")
        if b:
            need = (f"a spare's recovery of at most {b['budget_s']} s (the model gives "
                    f"{b['model_recover_s']} s)" if b["budget_s"] is not None else
                    "more than a free recovery: even at 0 s it reaches "
                    f"{b['free_recovery_effective']:.3f}")
            rows += ["", f"To reach {b['target']} there, spares + tiers need {need}."]
        w = sens.get("world_off_path")
        if w:
            rows += ["", f"What if a recovery rebuilt only the groups that held the failed "
                     f"rank (the world group off its path, which the code does not do yet; "
                     f"the largest rebuilt {w['rebuilt_ranks']:,} ranks): spares + tiers "
                     f"{w['effective']:.3f}, a spare's recovery {w['recover_s']} s."]
    return rows


def _v(x) -> str:
    return f"{x:.3g}" if isinstance(x, float) else str(x)


def show(result: dict, validated_from: str | None) -> None:
    """The console's tables: effective throughput per rate and size, the crossover, and
    the validation against `validated_from` (when it ran)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="effective throughput (failure-free = 1.00), mean of "
                        f"{result['runs']} runs of {result['horizon_h']:.0f} h")
    for col in ("rate", "GPUs", "job MTBF", *STRATEGIES, "tiers / restart"):
        table.add_column(col, justify="right")
    for r in result["rows"]:
        table.add_row(r["rate"], f"{r['gpus']:,}", f"{r['mtbf_min']:.1f} min",
                      *(f"{r[s]:.3f}" for s in STRATEGIES),
                      f"{r['tiers_vs_restart']}x" if r["tiers_vs_restart"] else "inf")
    Console().print(table)
    cross = result["crossover_2_23x"]
    print(f"ReCoVer reaches 2.23x checkpoint-and-restart at 16k GPUs when the job's MTBF is "
          f"{cross['job_mtbf_min']:.1f} min ({cross['per_gpu_hour']:.2e} failures per GPU-hour)")
    for line in scale_markdown(result):
        print(line)
    if not validated_from:
        return
    v = Table(title=f"validation against {validated_from} (goal: error <= 10%)")
    for col in ("mode", "predicted ratio", "measured ratio", "error"):
        v.add_column(col, justify="right")
    for c in result["validation"]:
        v.add_row(c["mode"], f"{c['predicted_ratio']:.3f}", f"{c['measured_ratio']:.3f}",
                  f"{100 * c['error']:.1f}%")
    Console().print(v)
