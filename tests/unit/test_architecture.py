"""The package's shape, checked from its source: no import circle (type-checking imports
included), no lower layer importing a higher one, serve's three parts apart (the engine
imports neither the recovery log nor the server, the log not the server), and no store key
spelled outside `phoenixft/cluster/keys.py`."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "phoenixft"

# Parts and their layer: a module may import its own part or a part of a lower layer.
LAYERS = {
    "observe": 0, "faults": 0, "models": 0, "platform": 0, "config": 0, "extras": 0,
    "torch_internals": 0,
    "comm": 1, "cluster": 1,
    "checkpoint": 2,
    "train": 3, "launch": 3, "serve": 3, "simulate": 3,
    "bench": 4,
    "cli": 5,
}
# Same-or-lower layer imports that are still not allowed (parts that must stay apart).
FORBIDDEN = {("serve", "train"), ("serve", "launch"), ("serve", "cluster"), ("launch", "train"),
             ("train", "launch"), ("train", "models")}


def module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources() -> dict[str, tuple[str, bool]]:
    """module -> (its source, whether it is a package's __init__)."""
    return {module_name(p): (p.read_text(), p.name == "__init__.py") for p in PKG.rglob("*.py")}


def import_graph(modules: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """module -> phoenixft modules it imports (anywhere in the file, TYPE_CHECKING too;
    relative imports resolved, so `from ..server import x` counts like the absolute one)."""
    out: dict[str, set[str]] = {}
    for mod, (source, is_pkg) in modules.items():
        deps = out.setdefault(mod, set())
        here = mod.split(".") if is_pkg else mod.split(".")[:-1]
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = here[:len(here) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                if base.startswith("phoenixft"):
                    deps.add(base)
                    deps.update(f"{base}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("phoenixft"))
    return {m: {d for d in deps if d in out and d != m} for m, deps in out.items()}


def imports() -> dict[str, set[str]]:
    return import_graph(sources())


def part(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "cli"


def test_no_import_circle():
    graph = imports()
    # packages' __init__ re-export lazily and import nothing; a package node would
    # otherwise make every "from package import module" look like a circle
    graph = {m: {d for d in deps if "__init__" not in d} for m, deps in graph.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                raise AssertionError("import circle: " + " -> ".join(stack[stack.index(d):] + [d]))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_layers():
    bad = []
    for mod, deps in imports().items():
        a = part(mod)
        for d in deps:
            b = part(d)
            if a == b or b == "phoenixft":
                continue
            if LAYERS[b] >= LAYERS[a] or (a, b) in FORBIDDEN:
                bad.append(f"{mod} imports {d} ({a} may not import {b})")
    assert not bad, "\n".join(sorted(bad))


STORE_METHODS = {"set", "get", "check", "add", "wait", "multi_get", "multi_set", "compare_set",
                 "delete_key"}
HELPERS = {"set_json", "get_json", "get_int", "raise_to"}


def _is_literal(node: ast.AST) -> bool:
    if isinstance(node, (ast.Constant, ast.JoinedStr)):
        return isinstance(node, ast.JoinedStr) or isinstance(node.value, str)
    if isinstance(node, (ast.List, ast.Tuple)):
        return any(_is_literal(e) for e in node.elts)
    if isinstance(node, ast.BinOp):  # "gen/" + str(g)
        return _is_literal(node.left) or _is_literal(node.right)
    return False


def key_literals(source: str) -> list[str]:
    """Store calls whose key argument is spelled in place."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        name = node.func.attr
        receiver = ast.unparse(node.func.value).lower()
        if name in STORE_METHODS and ("store" in receiver or "server" in receiver):
            key = node.args[0] if node.args else None
        elif name in HELPERS or name == "PrefixStore":
            key = node.args[1] if len(node.args) > 1 else (node.args[0] if name == "PrefixStore"
                                                           and node.args else None)
        else:
            continue
        if key is not None and _is_literal(key):
            out.append(f"line {node.lineno}: {ast.unparse(node)[:100]}")
    return out


def test_store_keys_are_built_only_in_the_key_module():
    found = []
    for path in PKG.rglob("*.py"):
        if path == PKG / "cluster" / "keys.py":
            continue
        found += [f"{path.relative_to(PKG.parent)} {hit}" for hit in key_literals(path.read_text())]
    assert not found, "store keys spelled outside cluster/keys.py:\n" + "\n".join(found)


def test_the_key_check_can_fail():
    src = ('store.set("job_id", x)\nkv.get_int(self.store, f"spawn/{i}", 0)\n'
           'self._server.check([f"recovered/{g}"])\nstore.add(Keys.REPORTS, 1)\n')
    assert len(key_literals(src)) == 3


# -- inside serve/: the engine, the recovery log, the server (docs/serving.md) -------------------
SERVE_PARTS = ("engine", "recovery", "server")
# (importer, imported): the engine knows the log only as its StepRecorder protocol, and
# neither the engine nor the log knows the HTTP server or the engine processes
SERVE_FORBIDDEN = {("engine", "recovery"), ("engine", "server"), ("recovery", "server")}


def serve_part(mod: str) -> str | None:
    parts = mod.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "serve" else None


def serve_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for mod, deps in graph.items():
        a = serve_part(mod)
        if a is not None and a not in SERVE_PARTS:  # a module beside the parts
            bad.append(f"{mod} is in none of serve's parts {SERVE_PARTS}")
        for d in deps:
            b = serve_part(d)
            if (a, b) in SERVE_FORBIDDEN:
                bad.append(f"{mod} imports {d} (serve.{a} may not import serve.{b})")
    return sorted(bad)


def test_serve_parts():
    bad = serve_violations(imports())
    assert not bad, "\n".join(bad)


def test_the_serve_parts_check_can_fail():
    graph = import_graph({
        "phoenixft.serve.engine.llm_engine": ("from phoenixft.serve.recovery.recorder import "
                                              "Recorder\n", False),
        "phoenixft.serve.engine.runner": ("from ..server import wire\n", False),
        "phoenixft.serve.engine.ok": ("from . import runner\n", False),
        "phoenixft.serve.recovery.recorder": ("import phoenixft.serve.server.http\n", False),
        "phoenixft.serve.recovery": ("", True),
        "phoenixft.serve.server": ("", True),
        "phoenixft.serve.server.wire": ("", False),
        "phoenixft.serve.server.http": ("from phoenixft.serve.engine.runner import x\n", False),
        "phoenixft.serve.stray": ("", False),
    })
    assert serve_violations(graph) == [
        "phoenixft.serve.engine.llm_engine imports phoenixft.serve.recovery.recorder "
        "(serve.engine may not import serve.recovery)",
        "phoenixft.serve.engine.runner imports phoenixft.serve.server "
        "(serve.engine may not import serve.server)",
        "phoenixft.serve.engine.runner imports phoenixft.serve.server.wire "
        "(serve.engine may not import serve.server)",
        "phoenixft.serve.recovery.recorder imports phoenixft.serve.server.http "
        "(serve.recovery may not import serve.server)",
        f"phoenixft.serve.stray is in none of serve's parts {SERVE_PARTS}",
    ]


TESTS = PKG.parent / "tests"


def sys_path_edits(paths) -> list[str]:
    """Calls that change sys.path (`sys.path.insert/append/extend`), as FILE:LINE."""
    out = []
    for path in paths:
        for node in ast.walk(ast.parse(Path(path).read_text())):
            f = node.func if isinstance(node, ast.Call) else None
            if (isinstance(f, ast.Attribute) and f.attr in ("insert", "append", "extend")
                    and isinstance(f.value, ast.Attribute) and f.value.attr == "path"
                    and isinstance(f.value.value, ast.Name) and f.value.value.id == "sys"):
                out.append(f"{path}:{node.lineno}")
    return out


def test_the_tests_put_nothing_on_sys_path():
    """Shared test helpers are the importable `tests.support` package."""
    assert not sys_path_edits(TESTS.rglob("*.py"))


def test_a_sys_path_edit_is_found(tmp_path):
    bad = tmp_path / "conftest.py"
    bad.write_text("import sys\nsys.path.insert(0, 'x')\n")
    assert sys_path_edits([bad]) == [f"{bad}:2"]


DOC = PKG.parent / "docs" / "architecture.md"


def tree_blocks(doc: str) -> dict[str, str]:
    """The "Parts" tree of docs/architecture.md: part path ("" for the top level,
    "train", "serve/engine", ...) -> the text of its lines."""
    body = doc.split("## Parts", 1)[1].split("```", 2)[1]
    blocks: dict[str, str] = {"": ""}
    top = current = ""
    for line in body.splitlines():
        head = line.strip().split(" ", 1)[0]
        indent = len(line) - len(line.lstrip())
        if head.endswith("/") and indent == 2:
            top = current = head.rstrip("/")
        elif head.endswith("/") and indent == 4:
            current = f"{top}/{head.rstrip('/')}"
        elif head.endswith(".py") and indent == 2 and "/" not in head:
            current = top = ""
        elif "/" in head and head.endswith(".py") and indent == 2:  # "observe/steps.py ..."
            current = top = head.split("/")[0]
        blocks[current] = blocks.get(current, "") + "\n" + line
    return blocks


def unnamed_modules(doc: str) -> list[str]:
    blocks = tree_blocks(doc)
    missing = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG)
        if rel.name == "__init__.py":
            continue
        where = "/".join(rel.parts[:-1])
        if not re.search(rf"(?<![\w.]){re.escape(rel.name)}", blocks.get(where, "")):
            missing.append(str(rel))
    return missing


def test_every_module_is_named_in_the_architecture_doc_under_its_part():
    missing = unnamed_modules(DOC.read_text())
    assert not missing, ("modules docs/architecture.md does not name under their part "
                         "(its Parts tree): " + ", ".join(missing))


def test_the_architecture_check_can_fail():
    doc = DOC.read_text().replace("layouts.py", "registry")
    assert unnamed_modules(doc) == ["train/layouts.py"]
