"""A persisted sharded job's state in torch.distributed.checkpoint's default format, as a
torchtitan user reads and writes it:
- the job ends by writing its final state (URL/checkpoint/step-N), which a process that
  never imports phoenixft loads with `dcp.load(state, checkpoint_id=DIR)` into a freshly
  built, differently sharded model and optimizer: its tensors digest to the job's final
  state digest; `ckpt export --format dcp` writes the same tensors; `ckpt verify` names an
  edited `.metadata`;
- a checkpoint plain torchrun wrote with `dcp.save` in torchtitan's layout starts a
  phoenixft job (`--init-from`) that goes on as the torchrun run does, bit for bit;
- no directory under the persist URL is ever loadable with missing parts, by either DCP
  reader: in a copy taken while the job runs, after the whole job was SIGKILLed, and after
  a clean end (where the one loadable directory is the whole final state)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from phoenixft.checkpoint import dcp_checkpoint
from phoenixft.observe.events import read_events
from phoenixft.train.digest import state_digest
from tests.integration.test_sharded import FSDP, _plain_torchrun
from tests.support.jobs import ROOT, kill_members, kill_tree, load, plain_torchrun, run_script, start
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.integration]
STEPS = 8


def _persisted(tmp_path: Path, url: Path, *launch: str, steps: int = STEPS, script_args=()):
    return run_script(tmp_path, FSDP, "--persist", str(url), "--persist-every", "2",
                      "--persist-cpu-share", "1", *launch, timeout=240,
                      script_args=("--steps", str(steps), *script_args))


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A 4-rank FSDP2 job, persisted, run to its end."""
    where = tmp_path_factory.mktemp("dcp-final")
    job = _persisted(where / "run", where / "ckpt", "--nproc", "4")
    assert job.rc == 0, job.out[-3000:]
    return job, where / "ckpt"


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "phoenixft.cli", *args], capture_output=True,
                          text=True, timeout=180, cwd=ROOT)


def _plain_load(tmp_path: Path, config: Path, ckpt: str) -> tuple[dict, dict]:
    """dcp_final_load.py under plain torchrun on 2 ranks: (the state it loaded, lr + step)."""
    from safetensors.torch import load_file

    out = tmp_path / "loaded.safetensors"
    plain_torchrun(2, ROOT / "tests/integration/scripts/dcp_final_load.py", str(config), ckpt,
                   str(out), cwd=tmp_path)
    return load_file(out), json.loads(Path(str(out) + ".json").read_text())


@pytest.mark.timeout(600)
def test_the_final_state_is_a_dcp_checkpoint_that_plain_torch_loads(tmp_path, finished):
    job, url = finished
    final = f"{url}/checkpoint/step-{STEPS}"
    assert job.summary["checkpoint"] == final and job.summary["checkpoint_error"] is None
    hf = tmp_path / "hf"
    assert _cli("ckpt", "export", str(url), "--to", str(hf)).returncode == 0
    loaded, extra = _plain_load(tmp_path, hf / "config.json", final)
    assert state_digest(loaded) == job.summary["final_state_digest"]
    assert extra == {"lr": 3e-3, "step": STEPS}
    # the same step exported on demand, from the records: the same tensors
    exported = tmp_path / "exported"
    p = _cli("ckpt", "export", "--format", "dcp", str(url), "--step", str(STEPS),
             "--to", str(exported))
    assert p.returncode == 0, p.stderr
    keys = dcp_checkpoint.saved_keys(final)
    assert set(dcp_checkpoint.saved_keys(str(exported))) == set(keys)
    a = {k: torch.zeros(m.size, dtype=m.properties.dtype) for k, m in keys.items()
         if hasattr(m, "size")}
    b = {k: torch.zeros_like(v) for k, v in a.items()}
    dcp_checkpoint.load(final, a)
    dcp_checkpoint.load(str(exported), b)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # verify: ok, then an edited .metadata is named
    ok = _cli("ckpt", "verify", str(url))
    assert ok.returncode == 0 and f"{final}: ok" in ok.stdout, ok.stdout + ok.stderr
    meta = exported / ".metadata"
    data = bytearray(meta.read_bytes())
    data[len(data) // 2] ^= 0x01
    meta.write_bytes(bytes(data))
    bad = _cli("ckpt", "verify", str(exported))
    assert bad.returncode == 1 and ".metadata: checksum mismatch" in bad.stdout, bad.stdout
    # `ckpt inspect URL | head`: its reader gone, it ends quietly (141, as on SIGPIPE)
    p = subprocess.Popen([sys.executable, "-m", "phoenixft.cli", "ckpt", "inspect", str(url)],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    p.stdout.close()
    _, err = p.communicate(timeout=120)
    assert p.returncode == 141 and "Traceback" not in err and "BrokenPipe" not in err, err


@pytest.mark.timeout(500)
def test_a_torchtitan_layout_checkpoint_from_plain_torchrun_starts_a_job(tmp_path):
    saved = tmp_path / "titan"
    _plain_torchrun(tmp_path / "first", 2, "--steps", "4", "--save-dcp", str(saved))
    longer = _plain_torchrun(tmp_path / "longer", 2, "--steps", str(STEPS))
    job = run_script(tmp_path / "run", FSDP, "--nproc", "2", "--spares", "1",
                     "--init-from", str(saved), "--inject", "kill:rank=1:step=6",
                     "--log-every", "2", timeout=240, script_args=("--steps", str(STEPS)))
    assert job.rc == 0, job.out[-3000:]
    assert job.of("initialized_from")[0]["step"] == 4
    # progress lines from the first step after the checkpoint's (none before step 2's
    # loss, which this job never had, were printed at all)
    assert [ln.split()[1] for ln in job.out.splitlines() if ln.startswith("step ")] == ["6", "8"]
    assert job.summary["losses"] == longer["losses"][4:]
    assert job.summary["final_state_digest"] == longer["final_state_digest"]
    # a directory that is not a DCP checkpoint is refused at launch, in one line
    bad = run_script(tmp_path / "bad", FSDP, "--nproc", "2", "--init-from", str(tmp_path),
                     timeout=60, script_args=("--steps", "2"))
    assert bad.rc == 2 and "--init-from" in bad.out and ".metadata: missing" in bad.out, bad.out


def _template(final: str) -> dict:
    """Every tensor of the whole state, to load into (NaN: what was not read shows)."""
    return {k: torch.full(m.size, float("nan"), dtype=m.properties.dtype)
            if m.properties.dtype.is_floating_point else torch.zeros(m.size, dtype=m.properties.dtype)
            for k, m in dcp_checkpoint.saved_keys(final).items() if hasattr(m, "size")}


def _loadable_dirs(root: Path, template: dict, whole: dict | None) -> list[str]:
    """Every directory under `root` tried with both of DCP's readers: the ones that load
    the whole state (each must then hold exactly `whole`); a load with holes fails."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, HuggingFaceStorageReader

    loadable = []
    for d in [root, *sorted(p for p in root.rglob("*") if p.is_dir())]:
        for reader in (FileSystemReader, HuggingFaceStorageReader):
            state = {k: v.clone() for k, v in template.items()}
            try:
                dcp.load(state, storage_reader=reader(str(d)))
            except (Exception, dcp.CheckpointException):
                continue
            assert whole is not None, f"{d} loads with {reader.__name__} mid-run"
            for k, v in whole.items():
                assert torch.equal(state[k], v), f"{d} ({reader.__name__}): {k} differs"
            loadable.append(f"{d.relative_to(root)}:{reader.__name__}")
    return loadable


@pytest.mark.timeout(600)
def test_no_directory_is_ever_loadable_with_missing_shards(tmp_path, finished):
    _, url = finished
    final = f"{url}/checkpoint/step-{STEPS}"
    template = _template(final)
    whole = {k: v.clone() for k, v in template.items()}
    dcp_checkpoint.load(final, whole)
    # after a clean end: only the final checkpoint loads, and it is whole
    assert _loadable_dirs(url, template, whole) == [f"checkpoint/step-{STEPS}:FileSystemReader"]
    # while a job runs: a copy taken once two steps were persisted (files half-written
    # included), and the job then SIGKILLed whole, agent and workers
    ckpt = tmp_path / "ckpt"
    p = start(tmp_path / "run", "--nproc", "4", "--persist", str(ckpt), "--persist-every", "2",
              "--persist-cpu-share", "1", "--inject", "node:rank=0:step=7", steps=None,
              script=FSDP, script_args=("--steps", str(STEPS)))
    try:
        wait_until(lambda: sum(e["event"] == "persisted" for e in
                               read_events(tmp_path / "run" / "events.jsonl")) >= 2,
                   180, "two persisted steps")
        shutil.copytree(ckpt, tmp_path / "midrun", ignore_dangling_symlinks=True)
        p.communicate(timeout=180)
    finally:
        kill_tree(p.pid)
        kill_members(tmp_path / "run")
    killed = load(tmp_path / "run", p.returncode, "")
    assert killed.rc == -9 and killed.of("persisted")
    assert _loadable_dirs(tmp_path / "midrun", template, None) == []
    assert _loadable_dirs(ckpt, template, None) == []

