"""`pip install phoenixft` without extras runs every command: the CLI builds its parsers
without importing any extra, and a command that needs one says which in one line (exit 2)
instead of a traceback. The fresh virtual environment itself is tried by `.ci/run`."""

from __future__ import annotations

import subprocess
import sys

import pytest

from phoenixft.cli import build_parser
from tests.support.jobs import ROOT


def _base(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tests.support.base_install", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def _commands() -> list[tuple[str, ...]]:
    """Every subcommand, nested ones too (bench goodput, ckpt export, ...)."""
    out = []

    def walk(parser, prefix):
        for action in parser._actions:
            if getattr(action, "choices", None) and hasattr(action, "_name_parser_map"):
                for name, sub in action._name_parser_map.items():
                    out.append((*prefix, name))
                    walk(sub, (*prefix, name))

    walk(build_parser(), ())
    return out


def test_the_command_list_is_complete():
    names = {" ".join(c) for c in _commands()}
    assert {"run", "demo", "serve", "status", "ckpt export", "simulate", "bench goodput"} <= names


@pytest.mark.timeout(300)
def test_every_command_prints_its_help_without_extras():
    # one interpreter for all of them (each start imports torch): --help exits via SystemExit
    code = ("import sys, runpy\n"
            "from tests.support import base_install\n"
            "bad = []\n"
            f"for args in {_commands()!r}:\n"
            "    sys.argv = ['phoenixft', *args, '--help']\n"
            "    try:\n"
            "        base_install.main()\n"
            "    except SystemExit as e:\n"
            "        if e.code not in (0, None): bad.append((args, e.code))\n"
            "    except Exception as e:\n"
            "        bad.append((args, repr(e)))\n"
            "print('BAD', bad)\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "BAD []" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]


@pytest.mark.timeout(200)
def test_a_command_that_needs_an_extra_names_it_in_one_line(tmp_path):
    p = _base("bench", "goodput", "--quick", "--out", str(tmp_path / "g.json"))
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    assert p.stderr.strip().splitlines() == [
        "phoenixft bench goodput needs psutil, which the base install does not include: "
        "pip install 'phoenixft[bench]'"], p.stderr
    assert "Traceback" not in p.stdout + p.stderr


@pytest.mark.timeout(200)
def test_simulate_runs_without_extras_and_says_what_it_left_out(tmp_path):
    p = _base("simulate", "--out", str(tmp_path / "s.json"), "--plot", str(tmp_path / "s.png"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "pip install 'phoenixft[plot]'" in p.stdout + p.stderr
    assert not (tmp_path / "s.png").exists()


def test_the_blocker_blocks():
    p = _base("plot", str(ROOT / "nonexistent-run"))
    assert p.returncode == 2  # (no events there: said before matplotlib is needed)
    code = ("from tests.support import base_install as b\n"
            "b.sys.meta_path.insert(0, b._NotInstalled())\nimport psutil")
    q = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert q.returncode != 0 and "No module named 'psutil'" in q.stderr
