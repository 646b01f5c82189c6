"""Each private PyTorch name phoenixft relies on (`phoenixft/torch_internals.py`) still
exists in the installed torch, with the parameters we pass: a torch upgrade that renames
or reshapes one fails here, by name, and not deep inside a run. And no module but
torch_internals touches one."""

from __future__ import annotations

import inspect
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from phoenixft.torch_internals import PRIVATE_NAMES, PrivateName

PACKAGE = Path(__file__).resolve().parents[2] / "phoenixft"
STATIC = [n for n in PRIVATE_NAMES if not n.instance]
ON_INSTANCES = [n for n in PRIVATE_NAMES if n.instance]


def parameters(obj) -> list[str]:
    """A callable's parameter names: from its signature, or for a pybind11 builtin from
    the signature its docstring starts with."""
    try:
        return list(inspect.signature(obj).parameters)
    except (TypeError, ValueError):
        first = (obj.__doc__ or "").splitlines()[0] if obj.__doc__ else ""
        return re.findall(r"(\w+):", first[first.find("(") + 1:first.rfind(")")])


@pytest.mark.parametrize("name", STATIC, ids=str)
def test_the_private_name_exists_with_the_parameters_we_pass(name: PrivateName):
    try:
        obj = name.resolve()
    except (AttributeError, ImportError) as exc:
        pytest.fail(f"torch no longer has {name} ({name.why}): {exc}")
    if name.params:
        assert callable(obj), f"{name} is not callable any more ({name.why})"
        have = parameters(obj)
        missing = [p for p in name.params if p not in have]
        assert not missing, f"{name} takes {have}; we pass {list(name.params)} ({name.why})"


_LIVE = r"""
import json, os, sys, tempfile
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from phoenixft.torch_internals import PRIVATE_NAMES
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
for m in model:
    fully_shard(m, mesh=init_device_mesh("cpu", (1,)))
fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
model(torch.randn(2, 4)).sum().backward()
param = next(model.parameters())
state = model[0]._get_fsdp_state()
group = state._fsdp_param_group
found = {"DTensor": param, "FSDPState": state, "FSDPParamGroup": group,
         "FSDPParam": group.fsdp_params[0]}
out = {}
for n in PRIVATE_NAMES:
    if n.instance:
        obj = found[n.owner.rsplit(":", 1)[1]]
        out[str(n)] = hasattr(obj, n.name)
print(json.dumps(out))
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def live() -> dict[str, bool]:
    """Which instance attributes a live one-rank FSDP2 model has (in a process of its own:
    it initializes torch.distributed)."""
    r = subprocess.run([sys.executable, "-c", _LIVE], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", ON_INSTANCES, ids=str)
def test_the_private_attribute_is_on_a_live_fsdp2_model(name: PrivateName, live):
    assert live.get(str(name)), f"a live FSDP2 model has no {name} any more ({name.why})"


def test_no_other_module_touches_a_private_torch_name():
    """Private torch modules imported, or a listed private name used, outside
    torch_internals (the other owner of a name of ours: SwapGroup implements c10d's
    group-naming hooks and forwards its collectives, named from the same list)."""
    names = {n.name for n in PRIVATE_NAMES if n.name.startswith("_")}
    private_import = re.compile(r"(?:from|import)\s+torch(?:\.\w+)*\._\w+")
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "torch_internals.py":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            used = [n for n in names if re.search(rf"\.{re.escape(n)}\b|\b{re.escape(n)}\(", code)]
            if private_import.search(code) or used:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{i}: {line.strip()}")
    allowed = ("def _set_group_name", "def _set_group_desc")
    found = [f for f in found if not any(a in f for a in allowed)]
    assert not found, "private torch names outside torch_internals:\n" + "\n".join(found)
