"""The benchmarks no other smoke test runs, end to end at their smallest sizes: `bench
all` on overhead (on/off blocks in one run and separate runs), `bench recovery` on a kill
and a hang, and `simulate` fed with their JSON; what each reports, never how fast."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def _phoenixft(*args, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "phoenixft.cli", *args], capture_output=True,
                          text=True, timeout=300, cwd=cwd)


@pytest.mark.timeout(400)
def test_bench_all_overhead_recovery_and_simulate(tmp_path):
    out, md = tmp_path / "all.json", tmp_path / "BENCHMARKS.md"
    r = _phoenixft("bench", "all", "--quick", "--only", "overhead", "--with",
                   "overhead:--pairs 1 --steps 12 --preset tiny --block 2 --blocks 4", "--out", str(out),
                   "--markdown", str(md), cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(out.read_text())
    assert set(report["benchmarks"]) == {"overhead", "simulate"}
    for name, b in report["benchmarks"].items():
        assert b["rc"] == 0 and b["goals"], name
        for g in b["goals"]:
            assert set(g) == {"name", "goal", "measured", "met"}
    assert report["benchmarks"]["overhead"]["command"].endswith("--blocks 4")
    ov = report["benchmarks"]["overhead"]["result"]
    assert ov["same_final_state"] is True and ov["ratio"] > 0
    for r in (ov["in_run"], ov["in_run_local_replica"]):
        assert r["pairs"] == len(r["pair_ratios"]) >= 2 and r["ratio"] > 0 and r["se"] >= 0
        assert 0 < r["thread_cpu_s_per_snapshot"] < r["median_step_off_s"]
    # one node: a replica only when asked for (--replicas 1)
    assert (ov["in_run"]["copies"], ov["in_run_local_replica"]["copies"]) == (1, 2)
    for section in ("## overhead", "## simulate", "| rate | GPUs |"):
        assert section in md.read_text()

    rec = tmp_path / "recovery.json"
    r = _phoenixft("bench", "recovery", "--trials", "0,3", "--steps", "16", "--preset", "tiny",
                   "--out", str(rec), cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(rec.read_text())["rows"]
    assert [r["fault"].split(":")[0] for r in rows] == ["kill", "stop"]
    assert all(r["source"] == "local_snapshot" and r["lost_steps"] <= 1 for r in rows)
    assert rows[0]["protocol_s"] >= 0  # the kill: its survivor met the failure
    assert all(r["step_s"] > 0 and abs(r["stall_s"] - (
        r["kill_to_next_step_s"] - (1 + r["lost_steps"]) * r["step_s"])) < 1e-3 for r in rows)

    sim = tmp_path / "sim.json"
    r = _phoenixft("simulate", "--recovery-json", str(rec), "--runs", "2", "--horizon-h", "24",
                   "--out", str(sim), cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    s = json.loads(sim.read_text())
    assert {x["gpus"] for x in s["rows"]} == {1024, 4096, 16384, 32768, 65536, 100000, 131072}
    assert s["costs"]["recover_s"] == rows[0]["recover_s"]
    assert [g["name"] for g in s["goals"]][:1] == [
        "phoenixft + tiers at 16k GPUs, Llama 3 failure rate"]
