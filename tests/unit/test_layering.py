"""The architecture rules that keep the package readable, checked on the source (STYLE.md section 8)."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "tokenmill"

# package -> top-level modules it must never import
FORBIDDEN = {
    "scheduler": ("torch", "tokenmill.worker", "tokenmill.model", "tokenmill.engine"),
    "kv_cache": ("torch", "tokenmill.worker", "tokenmill.model", "tokenmill.engine", "tokenmill.scheduler"),
    "model": ("tokenmill.engine", "tokenmill.scheduler", "tokenmill.server"),
    "layers": ("tokenmill.engine", "tokenmill.scheduler", "tokenmill.server"),
    "worker": ("tokenmill.engine", "tokenmill.server"),
    "executor": ("tokenmill.engine", "tokenmill.server"),
    "distributed": ("tokenmill.engine", "tokenmill.server", "tokenmill.worker", "tokenmill.model"),
    "engine": ("fastapi", "uvicorn", "tokenmill.server"),
}


def imported_modules(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_dependencies_point_one_way(package):
    for path in sorted((PACKAGE / package).rglob("*.py")):
        for name in imported_modules(path):
            for banned in FORBIDDEN[package]:
                assert not (name == banned or name.startswith(banned + ".")), f"{path.name} imports {name}"


def test_no_module_over_the_hard_size_budget():
    too_big = [f"{p.relative_to(PACKAGE)} ({n} lines)" for p in PACKAGE.rglob("*.py")
               if (n := len(p.read_text().splitlines())) > 800]
    assert not too_big


def test_every_kernel_module_fixes_its_triton_cache_keys():
    """Triton's cache key of a kernel depends on which kernels a process hashed first unless every module
    hashes its own at import (kernels.fix_cache_keys): a module that forgets it breaks the background compile
    and the disk cache's hits across restarts."""
    for path in sorted((PACKAGE / "kernels").glob("*.py")):
        tree = ast.parse(path.read_text())
        defines_kernels = any(isinstance(node, ast.FunctionDef) and any("triton.jit" in ast.unparse(d)
                                                                          for d in node.decorator_list)
                              for node in tree.body)
        if not defines_kernels:
            continue
        last = tree.body[-1]
        assert isinstance(last, ast.Expr) and ast.unparse(last.value) == "fix_cache_keys(globals())", path.name
