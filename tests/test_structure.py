"""The package's shape: imports run one way (the import-linter contracts in pyproject.toml), no
import cycle, modules and functions that fit on a screen."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "vramwatch"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_package_has_no_import_cycle() -> None:
    assert _cycles(grimp.build_graph("vramwatch")) == []


def test_the_cycle_finder_finds_a_cycle(tmp_path, monkeypatch) -> None:
    pkg = tmp_path / "cyclic"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from cyclic import b\n")
    (pkg / "b.py").write_text("from cyclic import c\n")
    (pkg / "c.py").write_text("import cyclic.a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _cycles(grimp.build_graph("cyclic", cache_dir=None)) == [["cyclic.a", "cyclic.b", "cyclic.c"]]


def test_imports_follow_the_layers() -> None:
    lint = shutil.which("lint-imports", path=os.path.dirname(sys.executable)) or shutil.which("lint-imports")
    if lint is None:
        if os.environ.get("CI"):
            pytest.fail("lint-imports (import-linter) is not installed: make install-test")
        pytest.skip("lint-imports not installed: pip install import-linter (make install-test)")
    result = subprocess.run([lint, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:]
    assert "0 broken" in result.stdout


def _sizes() -> tuple[list[str], list[str]]:
    long_modules, long_functions = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        lines = source.count("\n")
        name = path.relative_to(ROOT).as_posix()
        if lines > MAX_MODULE_LINES:
            long_modules.append(f"{name}: {lines} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long_functions.append(f"{name}:{node.lineno} {node.name}: {length} lines")
    return long_modules, long_functions


def test_modules_and_functions_fit_on_a_screen() -> None:
    long_modules, long_functions = _sizes()
    assert long_modules == [], f"modules over {MAX_MODULE_LINES} lines"
    assert long_functions == [], f"functions over {MAX_FUNCTION_LINES} lines"


#: modules directly in vramwatch/collector/ at most (the rest live in its sub-packages by concern)
MAX_COLLECTOR_MODULES = 12
#: test files directly in tests/ at most (the rest are filed by package: tests/<package>/)
MAX_ROOT_TEST_FILES = 10
#: classes that may share a name: callbacks a framework finds by its own base class
SHARED_CLASS_NAMES = {"VramwatchCallback"}
#: module names one layer each may use for its part of one role (an app, its server, a store's and an
#: engine's core, settings, schemas, routes, helpers shared by one package, the advice decided and served,
#: the foreign processes named and received, the store's and the API's reads, the hook's and the
#: collector's exporters, the errors root and the store's kinds of it); every other name means one thing
ROLE_MODULE_NAMES = {"__init__", "__main__", "app", "server", "core", "config", "schema", "routes", "common",
                     "advice", "processes", "reads", "exporters", "errors"}


def test_the_collector_keeps_its_modules_in_sub_packages() -> None:
    direct = sorted(p.name for p in (PACKAGE / "collector").glob("*.py"))
    assert len(direct) <= MAX_COLLECTOR_MODULES, direct


def test_tests_are_filed_by_package() -> None:
    direct = sorted(p.name for p in (ROOT / "tests").glob("test_*.py"))
    assert len(direct) <= MAX_ROOT_TEST_FILES, direct


def _classes() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                found.setdefault(node.name, []).append(path.relative_to(ROOT).as_posix())
    return found


def test_one_class_per_name_across_the_package() -> None:
    shared = {name: where for name, where in _classes().items() if len(where) > 1 and name not in SHARED_CLASS_NAMES}
    assert shared == {}, "one class per name: rename to what each means"


def test_one_meaning_per_module_name() -> None:
    # cli/ names a command after what it commands (cli/evidence.py runs the evidence package)
    modules = [p for p in PACKAGE.rglob("*.py") if "cli" not in p.relative_to(PACKAGE).parts]
    packages = {p.name for p in PACKAGE.rglob("*") if p.is_dir() and (p / "__init__.py").exists()}
    stems: dict[str, list[str]] = {}
    for path in modules:
        stems.setdefault(path.stem, []).append(path.relative_to(ROOT).as_posix())
    repeated = {s: w for s, w in stems.items() if s not in ROLE_MODULE_NAMES and (len(w) > 1 or s in packages)}
    assert repeated == {}, "a module name that means two things"


def test_the_checks_see_a_repeated_class_name(tmp_path, monkeypatch) -> None:
    for name in ("a", "b"):
        (tmp_path / f"{name}.py").write_text("class Outcome:\n    pass\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert _classes() == {"Outcome": ["a.py", "b.py"]}


def test_byte_counts_are_formatted_by_units_only() -> None:
    """GiB text comes from vramwatch.units (one rule for every number a person reads)."""
    import re

    by_hand = re.compile(r"/\s*(?:2\s*\*\*\s*30|GIB|gib|1024\s*\*\*\s*3)\b[^\n]*GiB")
    found = [f"{p.relative_to(ROOT)}:{i}" for p in PACKAGE.rglob("*.py") if p.name != "units.py"
             for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if by_hand.search(line)]
    assert found == []
