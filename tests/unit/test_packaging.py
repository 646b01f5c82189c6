"""Every third-party import of the package is declared in pyproject.toml: the core's in
`dependencies`, the benchmarks' in the `bench` extra (torchft's side in `torchft`), the S3
tier's in `s3`."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
# import name -> distribution name, where they differ
DIST = {"yaml": "pyyaml", "sklearn": "scikit-learn"}


def _declared(reqs: list[str]) -> set[str]:
    return {re.split(r"[<>=\[ ;]", r, maxsplit=1)[0].lower() for r in reqs}


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_every_import_is_declared():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = _declared(meta["dependencies"])
    extras = {k: _declared(v) for k, v in meta["optional-dependencies"].items()}
    stdlib = set(sys.stdlib_module_names) | {"phoenixft"}
    missing = []
    for path in sorted((ROOT / "phoenixft").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        allowed = core | (extras["bench"] if "/bench/" in rel else set()) | extras["s3"]
        allowed |= {"transformers"} if "/bench/" in rel else set()
        allowed |= (extras["torchft"] if rel.endswith(("bench/torchft_job.py",
                                                        "bench/torchft_hsdp_job.py")) else set())
        allowed |= extras["plot"] if rel.endswith(("observe/plot.py", "simulate/plot.py")) else set()
        for mod in _imports(path) - stdlib:
            if DIST.get(mod, mod).replace("_", "-") not in allowed and mod not in allowed:
                missing.append(f"{rel}: {mod}")
    assert not missing, "undeclared imports: " + ", ".join(missing)


def test_the_check_can_fail(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("import somethingelse\nfrom torch import nn\n")
    assert _imports(p) == {"somethingelse", "torch"}
