"""The size-dependent cost model (simulate/scale.py), its place in the projection, the
sensitivity table and the published points."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from phoenixft.simulate import scale
from phoenixft.simulate.model import Costs, projection, sized
from phoenixft.simulate.published import deadpool, ft_hsdp, step_s
from phoenixft.simulate.rates import RATES
from phoenixft.simulate.sensitivity import recovery_budget, sensitivity

S = scale.ScaleInputs()


def test_recovery_grows_with_the_job_and_the_model():
    sizes = [1024, 16384, 100000, 131072]
    recs = [scale.recovery_s(S, n) for n in sizes]
    assert recs == sorted(recs) and recs[-1] > 10 * recs[0]
    restarts = [scale.terms(S, n)["restart"] for n in sizes]
    assert restarts == sorted(restarts)
    big = replace(S, params=4 * S.params)  # a larger model: more state to move and save
    for n in sizes:
        assert scale.recovery_s(big, n) > scale.recovery_s(S, n)
        assert scale.terms(big, n)["restart"] > scale.terms(S, n)["restart"]
        assert scale.terms(big, n)["transfer"] == pytest.approx(4 * scale.terms(S, n)["transfer"])
    # a shard that the step cannot hide its copy under costs throughput
    assert scale.snapshot_overhead(replace(S, params=1e13), 1024, 1.0) > S.snapshot_floor
    assert scale.snapshot_overhead(S, 16384, 10.0) == S.snapshot_floor


def test_every_input_names_its_source():
    table = S.as_table()
    assert {r["name"] for r in table} == set(scale.SOURCES)
    assert all(r["source"] for r in table)


def test_the_control_plane_fit_is_read_from_the_benchmark(tmp_path):
    rows = [{"members": n, "control_s": 1e-4 * n ** 1.2} for n in (64, 256, 1024, 4096)]
    (tmp_path / "cp.json").write_text(json.dumps({"rows": rows}))
    s = S.with_measured(str(tmp_path / "cp.json"))
    assert s.control_a == pytest.approx(1e-4) and s.control_b == pytest.approx(1.2)
    assert S.with_measured(str(tmp_path / "missing.json")) == S


def test_the_projection_uses_the_costs_at_each_size():
    c = Costs(outage_per_day=0.0)
    c16, c100 = sized(c, S, 16384), sized(c, S, 100000)
    assert c100.recover_s > c16.recover_s and c100.restart_s > c16.restart_s
    assert sized(c, None, 100000) == c  # without the model: the constants as they were
    rows = projection(c, [16384, 100000], {"projected": RATES["projected"]}, runs=2,
                      horizon_h=24, s=S)
    assert rows[0]["recover_s"] < rows[1]["recover_s"]
    assert rows[0]["tiers"] > rows[1]["tiers"]


def test_sensitivity_names_what_moves_the_100k_projection():
    c = Costs()
    sens = sensitivity("tiers", 100000, RATES["projected"], c, S, runs=2, horizon_h=24)
    top = [r["input"] for r in sens["rows"][:3]]
    assert "comm_per_krank_s" in top and "failure rate" in top
    assert all(r["swing"] >= 0 for r in sens["rows"])
    b = recovery_budget("tiers", 100000, RATES["projected"], c, S, 0.9, runs=2, horizon_h=24)
    assert b["budget_s"] is None or b["budget_s"] < b["model_recover_s"]


def test_deadpool_point_from_its_inputs():
    p = deadpool(S, lost_steps=1.0)
    assert p["terms"]["step_redone"] == pytest.approx(step_s(65e9, 4e6, 512, 312, 0.5), rel=1e-2)
    assert p["predicted"] == pytest.approx(sum(p["terms"].values()), rel=1e-2)
    assert p["within"] == (p["predicted"] <= 40.0)


def test_a_recovery_is_charged_the_communicators_it_rebuilds():
    """While the code rebuilds the world group every generation, a recovery (and an HSDP
    group leaving) is charged the rebuild of G ranks; with it off the path (a what-if)
    only the largest group that held the failed rank: G / group_gpus ranks at 100k."""
    off = replace(S, world_group_rebuilt=False)
    assert scale.rebuilt_ranks(S, 100000) == 100000
    assert scale.rebuilt_ranks(off, 100000) == 100000 // S.group_gpus
    assert scale.rebuilt_ranks(off, 1024) == S.group_gpus  # the in-group mesh is larger
    assert scale.terms(S, 100000)["comm"] == pytest.approx(S.comm_base_s + 150.0)
    assert scale.terms(off, 100000)["comm"] < 10
    assert scale.group_loss_s(S, 100000) > scale.group_loss_s(off, 100000) + 140
    assert scale.terms(off, 100000)["restart"] == scale.terms(S, 100000)["restart"]


def test_ft_hsdp_point_from_its_own_inputs():
    """The failure rate FT-HSDP's synchronous figures imply (10-minute stalls, 44%), then
    its 3-minute stall at that rate: the simulator's effective time beside its 80%."""
    p = ft_hsdp(S, Costs(), runs=4, horizon_h=168.0)
    assert 15 < p["terms"]["implied_job_mtbf_min"] < 20  # 600 s / (1 - 0.44) = 17.9 min
    assert p["within"] == (abs(p["predicted"] - 0.80) <= 0.05)
    assert 0.75 < p["predicted"] < 0.90 and 0 < p["ours"] <= 1
