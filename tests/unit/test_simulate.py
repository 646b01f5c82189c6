"""The failure simulator: its limits (no failures, failures faster than a restart), the
Young/Daly interval, and the validation arithmetic on a run whose costs are known."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from phoenixft.simulate.measured import hsdp_costs
from phoenixft.simulate.model import Costs, Strategy, mean_effective, simulate, young_daly
from phoenixft.simulate.rates import RATES
from phoenixft.simulate.validate import _replay, validate


def test_without_failures_only_the_overheads_remain():
    c = Costs(outage_per_day=0.0, snapshot_overhead=0.02)
    for strategy in ("spares", "tiers"):
        o = simulate(strategy, 1024, 1e-12, c, horizon_h=24)
        spare_gpus = math.ceil(c.spare_frac * 1024 / 8) * 8
        assert abs(o.effective - 0.98 * 1024 / (1024 + spare_gpus)) < 1e-6
    assert abs(simulate("recover", 1024, 1e-12, c, horizon_h=24).effective - 1.0) < 1e-6


def test_checkpoint_restart_stops_progressing_when_failures_outpace_restarts():
    c = Costs(restart_s=600, outage_per_day=0.0)
    rate = 1 / (5 * 60) / 100_000 * 3600  # a failure every 5 minutes at 100k GPUs
    assert simulate("restart", 100_000, rate, c, horizon_h=24).effective < 0.01
    assert mean_effective("tiers", 100_000, rate, c, 2, 24).effective > 0.8


def test_young_daly_and_published_rates():
    assert abs(young_daly(60, 3600) - math.sqrt(2 * 60 * 3600)) < 1e-9
    # Llama 3: 419 interruptions in 54 days on 16,384 GPUs -> about one every 3.1 hours
    assert abs(1 / (RATES["llama3"] * 16384) - 54 * 24 / 419) < 1e-9


def test_replay_charges_each_fault_and_the_slowdown_after_it():
    wall = _replay([5.0, 10.0], steps=100, step_s=0.1, cost=lambda done: 1.0,
                   slow=lambda k: 1.0)
    assert abs(wall - (100 * 0.1 + 2 * 1.0)) < 1e-9
    shrink = _replay([5.0], steps=100, step_s=0.1, cost=lambda done: 0.0,
                     slow=lambda k: 2.0 if k else 1.0)
    assert abs(shrink - (5.0 + 50 * 0.2)) < 1e-9


def test_validation_of_a_run_whose_costs_are_known():
    step = 0.1
    clean = {"eff_steps_s": 1 / step, "completed": True, "final_step": 101,
             "first_step_after_launch_s": 0.0, "kills": []}
    spares_wall = 100 * step + 2 * (0.2 + 0.3 + 1 * step)
    run = {"nproc": 2, "cpu_count": 2, "ckpt_every": 10,
           "modes": {"clean": clean,
                     "spares": {"eff_steps_s": 100 / spares_wall, "completed": True,
                                "final_step": 101, "first_step_after_launch_s": 1.0,
                                "median_step_s": step, "wall_s": spares_wall,
                                "kills": [{"t_rel": 3.0}, {"t_rel": 6.0}]}}}
    rec = {"rows": [{"nproc": 2, "fault": "kill:rank=1:step=5", "detect_s": 0.2,
                     "recover_s": 0.3, "lost_steps": 1}]}
    (row,) = validate(run, rec)
    assert row["mode"] == "spares" and row["error"] < 1e-3


def test_hsdp_with_one_node_groups_is_tiers_and_larger_groups_cost_more():
    """A replica group of one node leaves what a node leaves; bigger groups lose more of
    the job per failure once the spares are gone (a 4-node group: 4x the throughput)."""
    rate = 1 / (20 * 60) / 16384 * 3600  # a failure every 20 minutes, repaired in 4 h
    c = Costs(outage_per_day=0.0, group_loss_s=Costs.detect_s + Costs.recover_s,
              lost_steps=0.0, spare_frac=1e-4)  # one spare node: ~11 of 2048 nodes out
    one = simulate("hsdp", 16384, rate, replace(c, group_nodes=1), horizon_h=48)
    tiers = simulate("tiers", 16384, rate, c, horizon_h=48)
    assert abs(one.effective - tiers.effective) < 1e-9
    four = simulate("hsdp", 16384, rate, replace(c, group_nodes=4), horizon_h=48)
    assert four.effective < one.effective - 0.01  # ~4 x 0.5% of the job out, not 0.5%
    plenty = replace(c, group_nodes=4, spare_frac=0.2)  # spares cover every failure
    assert simulate("hsdp", 16384, rate, plenty, horizon_h=48).effective == pytest.approx(
        simulate("tiers", 16384, rate, replace(plenty, group_nodes=1), horizon_h=48).effective)


def test_a_group_loss_is_read_from_an_hsdp_goodput_run(tmp_path):
    run = tmp_path / "goodput-hsdp.json"
    run.write_text(json.dumps({"layout": "hsdp 2x2", "modes": {"shrink": {"recoveries": [
        {"replacement": None, "detect_s": 0.05, "recover_s": 0.15},
        {"replacement": None, "detect_s": 0.05, "recover_s": 0.35}]}}}))
    assert hsdp_costs(str(run), Costs()).group_loss_s == pytest.approx(0.3)
    assert hsdp_costs(str(tmp_path / "none.json"), Costs()) == Costs()
    run.write_text(json.dumps({"layout": "dp", "modes": {}}))
    with pytest.raises(SystemExit, match="--dp-shard"):
        hsdp_costs(str(run), Costs())


def test_an_unknown_strategy_is_named_not_run_as_another():
    with pytest.raises(ValueError, match="unknown strategy 'spare': one of restart, spares, "
                                         "recover, tiers, hsdp"):
        simulate("spare", 1024, 1e-5, Costs())
    assert simulate("spares", 1024, 1e-5, Costs()).strategy is Strategy.SPARES
