"""Run `phoenixft` as a base install (no extras) would: every optional dependency of
pyproject.toml is made unimportable before the CLI is imported, whatever this environment
has installed. Used as `python -m tests.support.base_install ARGS...`."""

from __future__ import annotations

import importlib.abc
import sys

from phoenixft.extras import EXTRA_OF

# the extras' modules, and the test extra's, which a user never has
BLOCKED = set(EXTRA_OF) | {"moto", "openai", "pytest", "boto3"}


class _NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


def main() -> int:
    for name in [m for m in sys.modules if m.split(".")[0] in BLOCKED]:
        del sys.modules[name]
    sys.meta_path.insert(0, _NotInstalled())
    from phoenixft.cli import main as cli

    return cli(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
