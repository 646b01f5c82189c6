"""The config tree (phoenixft/config.py) and the run CLI built from one declaration per
option (launch/options.py): every check names its setting in the caller's words, the
agent hands the workers' branches over whole, and no option is declared twice."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from phoenixft.config import (
    ConfigError,
    Persistence,
    Policy,
    Snapshots,
    StragglerAction,
    Stragglers,
    Timeouts,
    build,
    default_of,
    to_dict,
)
from phoenixft.launch.config import AgentConfig, LaunchError
from phoenixft.launch.options import OPTIONS, PLACEMENT, add_run_arguments, agent_config_from_args, flag_of
from phoenixft.train.config import SessionConfig


def _parse(*argv: str, script: str) -> AgentConfig:
    p = argparse.ArgumentParser()
    add_run_arguments(p)
    return agent_config_from_args(p.parse_args([*argv, script]))


@pytest.fixture
def script(tmp_path):
    s = tmp_path / "train.py"
    s.write_text("")
    return str(s)


def test_each_branch_checks_itself_and_names_the_setting_by_its_path():
    cases = [(lambda: Timeouts(heartbeat_timeout_s=math.nan), "heartbeat_timeout_s must be a finite"),
             (lambda: Timeouts(join_timeout_s=0), "join_timeout_s must be a finite"),
             (lambda: Timeouts(heartbeat_timeout_s=0.3), "must exceed twice the heartbeat"),
             (lambda: Snapshots(blocks=3), "blocks must be 0 or even, got 3"),
             (lambda: Snapshots(replicas=-1), "replicas must be >= 0"),
             (lambda: Persistence(every=0), "every must be >= 1, got 0"),
             (lambda: Persistence(cpu_share=math.nan), "cpu_share must be in (0, 1], got nan"),
             (lambda: Persistence(resume=True), "resume needs url"),
             (lambda: Persistence(url="  "), "url is empty"),
             (lambda: Stragglers(action="loud"), "action must be one of off, report, swap, "
                                                 "rebalance"),
             (lambda: Stragglers(window=2), "window must be an integer >= 3"),
             (lambda: Stragglers(ratio=math.nan), "ratio must be a finite number > 1"),
             (lambda: Stragglers(ratio=1.0), "ratio must be a finite number > 1")]
    for make, words in cases:
        with pytest.raises(ConfigError) as e:
            make()
        assert words in str(e.value), (words, str(e.value))


def test_build_takes_a_nested_dict_and_names_the_path_at_fault():
    s = build(SessionConfig, {"worker_id": "n0w3", "timeouts": {"join_timeout_s": 5},
                              "persistence": {"url": "/tmp/x", "every": 3},
                              "policy": "shrink-batch"})
    assert s.timeouts.join_timeout_s == 5 and s.timeouts.collective_timeout_s == 60
    assert s.persistence == Persistence(url="/tmp/x", every=3)
    assert s.policy is Policy.SHRINK_BATCH and f"{s.policy}" == "shrink-batch"
    s = build(SessionConfig, {"worker_id": "n0w3", "stragglers": {"action": "swap"}})
    assert s.stragglers.action is StragglerAction.SWAP and f"{s.stragglers.action}" == "swap"
    assert Stragglers(action="off").action is StragglerAction.OFF  # (a value is taken too)
    with pytest.raises(ConfigError, match=r"^persistence\.keep must be >= 1, got 0$"):
        build(SessionConfig, {"persistence": {"keep": 0}})
    with pytest.raises(ConfigError, match=r"policy must be one of 'constant', 'shrink-batch'"):
        build(SessionConfig, {"policy": "sometimes"})
    with pytest.raises(ConfigError, match=r"unknown setting persist_url for SessionConfig"):
        build(SessionConfig, {"persist_url": "/tmp/x"})  # the old flat name is refused
    with pytest.raises(ConfigError, match=r"unknown setting evry for Persistence"):
        build(SessionConfig, {"persistence": {"evry": 3}})


def test_the_agent_hands_the_workers_branches_over_whole(script, tmp_path, monkeypatch):
    cfg = _parse("--persist", str(tmp_path / "ck"), "--persist-every", "4", "--replicas", "0",
                 "--heartbeat-timeout", "7", "--policy", "shrink-batch", script=script)
    monkeypatch.setenv("PHOENIXFT_STORE", "127.0.0.1:1")
    monkeypatch.setenv("PHOENIXFT_WORKER_ID", "n0w1")
    monkeypatch.setenv("PHOENIXFT_SHM_DIR", str(tmp_path))
    monkeypatch.setenv("PHOENIXFT_CONFIG", json.dumps({"local_addr": "127.0.0.1",
                                                       **cfg.worker_settings()}))
    s = SessionConfig.from_env()
    assert (s.timeouts, s.snapshots, s.persistence, s.policy) == \
        (cfg.timeouts, cfg.snapshots, cfg.persistence, cfg.policy)
    assert s.persistence.every == 4 and s.timeouts.heartbeat_timeout_s == 7
    assert to_dict(build(Persistence, to_dict(cfg.persistence))) == to_dict(cfg.persistence)


def test_cli_defaults_are_the_trees_and_errors_name_the_flag(script):
    cfg = _parse(script=script)
    assert cfg == AgentConfig(script=script, store=cfg.store, nproc=cfg.nproc)
    assert cfg.persistence == Persistence() and cfg.timeouts == Timeouts()
    for argv, words in [(["--persist-keep", "0"], "--persist-keep must be >= 1, got 0"),
                        (["--resume"], "--resume needs --persist (where"),
                        (["--heartbeat-timeout", "0.3"], "--heartbeat-timeout must exceed"),
                        (["--spares", "-1"], "--spares must be >= 0"),
                        (["--min-nproc", "5"], "--min-nproc must be in [1, 1], got 5"),
                        (["--straggler-ratio", "1"], "--straggler-ratio must be a finite"),
                        (["--straggler-window", "1"], "--straggler-window must be an integer")]:
        with pytest.raises(LaunchError) as e:
            _parse(*argv, script=script)
        assert str(e.value).startswith(words), (argv, str(e.value))


def test_every_option_is_declared_once_and_fills_a_real_setting():
    flags = [f for o in (*PLACEMENT, *OPTIONS) for f in o.flags]
    assert len(flags) == len(set(flags)), "a flag is declared twice"
    paths = [o.path for o in OPTIONS]
    assert len(paths) == len(set(paths)), "two options fill one setting"
    for o in OPTIONS:
        default_of(AgentConfig, o.path)  # raises KeyError for a path the tree lacks
        assert flag_of(o.path) in o.flags
    with pytest.raises(KeyError):
        default_of(AgentConfig, "persistence.evry")
