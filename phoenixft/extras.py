"""Optional dependencies: which extra of the package installs each one, and the one line a
command says when it needs one that is not installed.

`pip install phoenixft` (no extras) runs every command but the benchmarks that drive other
systems, the plots and the S3 tier. Those import their dependency where they use it, never
at module level (the CLI imports every command's module to build its parser, so one
module-level import of an extra broke every command of a base install). `cli.main` turns a
`ModuleNotFoundError` of a module named here into `hint(...)`'s line and exit code 2.
"""

from __future__ import annotations

# import name -> the extra that installs it (pyproject.toml's optional-dependencies)
EXTRA_OF = {
    "psutil": "bench",
    "transformers": "bench",
    "httpx": "bench",
    "matplotlib": "plot",
    "s3fs": "s3",
    "torchft": "torchft",
}


def hint(exc: ModuleNotFoundError, command: str = "this command") -> str | None:
    """The one line for a missing optional module, or None when `exc` is about another one
    (a real bug, which must keep its traceback)."""
    root = (exc.name or "").split(".")[0]
    extra = EXTRA_OF.get(root)
    if extra is None:
        return None
    return (f"{command} needs {root}, which the base install does not include: "
            f"pip install 'phoenixft[{extra}]'")
