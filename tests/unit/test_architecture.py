"""The package's layers hold (STYLE.md §1): checked by import-linter on the package as pyproject assembles it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def assemble_package(dest: Path) -> Path:
    """Copy every mapped package directory to where it lives in the installed ``fulcrum`` tree."""
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping: dict[str, str] = cfg["package-dir"]
    for pkg in cfg["packages"]:
        base = max((k for k in mapping if pkg == k or pkg.startswith(k + ".")), key=len)
        src = REPO / mapping[base] / Path(*pkg[len(base) :].lstrip(".").split(".") if pkg != base else ())
        dst = dest / Path(*pkg.split("."))
        dst.mkdir(parents=True, exist_ok=True)
        for f in src.glob("*.py"):
            shutil.copy2(f, dst / f.name)
    return dest


def test_operator_folder_is_not_a_package():
    # operator/__init__.py would shadow the standard library's operator module from the repository root
    assert not (REPO / "operator" / "__init__.py").exists()


def test_import_contracts_hold(tmp_path):
    if shutil.which("lint-imports") is None:
        pytest.skip("import-linter is not installed (pip install -e '.[test]')")
    root = assemble_package(tmp_path / "pkg")
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())",
         "--config", str(REPO / ".importlinter"), "--no-cache"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Contracts: 2 kept, 0 broken" in proc.stdout


def test_whole_package_type_checks_strictly(tmp_path):
    """STYLE.md §14: mypy --strict (the project's own config) holds on the whole ``fulcrum`` package."""
    pytest.importorskip("mypy", reason="mypy is not installed (pip install -e '.[test]')")
    root = assemble_package(tmp_path / "pkg")
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(REPO / "pyproject.toml"), "--cache-dir", str(tmp_path / "cache"),
         "-p", "fulcrum"],
        cwd=root, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_simulator_defines_no_routing_or_batching_algorithm_of_its_own():
    """Issue 12: the simulator routes through the router's policies and batches prefills with the router's DOPD
    Alg. 1 batcher (fulcrum.routing); it must not grow its own copy of either again."""
    import ast
    import re

    routing_name = re.compile(r"^(route|_?route_.*|_?choose.*|.*least_loaded.*|_?pick_(decode|prefill).*)$")
    imported_policy = False
    for path in sorted((REPO / "simulator").glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert not routing_name.match(node.name), (
                    f"{path.name}: {node.name}() looks like a routing algorithm; use a fulcrum.routing Policy")
            if isinstance(node, ast.ClassDef):
                methods = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
                assert "take" not in methods, f"{path.name}: class {node.name} has a batching take(); use PrefillBatcher"
                assert not node.name.endswith(("Policy", "Batcher", "Queue")), (
                    f"{path.name}: class {node.name} duplicates fulcrum.routing")
            if isinstance(node, ast.ImportFrom) and node.module == "fulcrum.routing.base":
                imported_policy = imported_policy or any(a.name == "Policy" for a in node.names)
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fulcrum.router"):
                assert node.module.startswith("fulcrum.routing"), f"{path.name} imports the router's data plane"
    assert imported_policy, "the simulator takes its Policy from fulcrum.routing.base"
