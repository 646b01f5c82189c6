"""`phoenixft bench all` end to end on the two benchmarks no other smoke test runs
(overhead, recovery), then the simulator fed with their JSON: what each reports and the
report's shape; never how fast anything was."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


@pytest.mark.timeout(400)
def test_bench_all_overhead_recovery_and_simulate(tmp_path):
    out, md = tmp_path / "all.json", tmp_path / "BENCHMARKS.md"
    r = subprocess.run([sys.executable, "-m", "phoenixft.cli", "bench", "all", "--quick",
                        "--only", "overhead,recovery", "--out", str(out), "--markdown", str(md)],
                       capture_output=True, text=True, timeout=380, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(out.read_text())
    assert set(report["benchmarks"]) == {"overhead", "recovery", "simulate"}
    for name, b in report["benchmarks"].items():
        assert b["rc"] == 0 and b["goals"], name
        for g in b["goals"]:
            assert set(g) == {"name", "goal", "measured", "met"}
    ov = report["benchmarks"]["overhead"]["result"]
    assert ov["same_final_state"] is True and ov["ratio"] > 0
    rows = report["benchmarks"]["recovery"]["result"]["rows"]
    assert {r["fault"].split(":")[0] for r in rows} == {"kill", "stop"}
    assert all(r["source"] == "local_snapshot" and r["lost_steps"] <= 1 for r in rows)
    sim = report["benchmarks"]["simulate"]["result"]
    assert {r["gpus"] for r in sim["rows"]} == {1024, 16384, 100000, 131072}
    assert sim["costs"]["recover_s"] == max(r["recover_s"] for r in rows
                                            if r["fault"].startswith("kill"))
    text = md.read_text()
    for section in ("## overhead", "## recovery", "## simulate", "| rate | GPUs |"):
        assert section in text
