"""`pip install tokenmill` alone must serve: every package the code imports comes with the base install."""

import ast
import pathlib
import re
import sys
from importlib.metadata import PackageNotFoundError, packages_distributions, requires

import tokenmill

OPTIONAL = {"triton", "matplotlib", "ray"}
"""Imported only where installed (tokenmill.kernels.triton_available), or only for an optional feature that says
what to install when it is missing (matplotlib: bench serve --plot, the `bench` extra; ray: the ray executor,
the `ray` extra)."""


def base_distributions() -> set[str]:
    """The base requirements of tokenmill and, transitively, theirs (no extras)."""
    found, todo = set(), [r for r in requires("tokenmill") or [] if "extra ==" not in r]
    while todo:
        name = re.split(r"[\s;<>=!~\[(]", todo.pop(), maxsplit=1)[0].lower().replace("_", "-")
        if name in found:
            continue
        found.add(name)
        try:
            todo += [r for r in requires(name) or [] if "extra ==" not in r]
        except PackageNotFoundError:
            pass
    return found


def imported_top_level_modules() -> set[str]:
    modules = set()
    for path in pathlib.Path(tokenmill.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules.add(node.module.split(".")[0])
    return modules - set(sys.stdlib_module_names) - {"tokenmill"} - OPTIONAL


def test_every_imported_package_is_a_base_dependency():
    base, owners = base_distributions(), packages_distributions()
    missing = {module: owners.get(module) for module in imported_top_level_modules()
               if not {d.lower().replace("_", "-") for d in owners.get(module, [module])} & base}
    assert not missing, f"imported but not installed by `pip install tokenmill`: {missing}"
