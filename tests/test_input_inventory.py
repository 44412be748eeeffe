"""The inventory of input surfaces (docs/reliability.md, "Input surfaces") guards the future: every
route of the collector and of the front, every module that opens a file or a socket, and every
environment variable the code reads has a row naming its bound, default and test; a row that
names something gone fails too. A route or a reader added without an entry fails here."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "reliability.md"

#: calls that read a file or open a socket (and ``fetch`` when imported from vramwatch.bounded)
OPENERS = {"open", "open_input", "read_text", "read_bytes", "urlopen", "create_connection", "create_server",
           "fetch_sync", "scandir", "AsyncClient", "HTTPConnection", "HTTPSConnection", "fromfd"}
#: attributes that name a connection class even when not called directly (``cls = ...``)
CONNECTION_CLASSES = {"HTTPConnection", "HTTPSConnection", "AsyncClient"}


def documented() -> set[str]:
    """Every backticked name in the first column of the inventory's rows."""
    text = DOC.read_text(encoding="utf-8")
    block = text[text.index("<!-- inputs:start -->"):text.index("<!-- inputs:end -->")]
    names: set[str] = set()
    for line in block.splitlines():
        if line.startswith("| ") and not line.startswith("| surface") and not line.startswith("|---"):
            names |= set(re.findall(r"`([^`]+)`", line.split(" | ")[0]))
    return names


def route_keys(routes: Iterable[Any], prefix: str = "") -> Iterator[str]:
    """``METHOD /path`` of every route, included routers and mounts too (HEAD left out)."""
    for route in routes:
        inner = getattr(route, "original_router", None)
        if inner is not None:  # FastAPI's included router
            yield from route_keys(inner.routes, prefix + route.include_context.prefix)
            continue
        path = re.sub(r"\{(\w+):path\}", r"{\1}", prefix + getattr(route, "path", ""))
        methods = getattr(route, "methods", None)
        if methods is None:  # a mount: static files
            yield f"GET {path}/{{path}}"
            continue
        yield from (f"{m} {path}" for m in sorted(methods - {"HEAD"}))


def app_routes() -> set[str]:
    from vramwatch.collector.serving.app import Settings, create_app
    from vramwatch.front import FrontSettings, PeerSource, create_front_app, parse_peers

    collector = create_app(Settings(db_path=str(ROOT / "never-opened.db")))
    front = create_front_app(FrontSettings(peers=PeerSource(static=parse_peers(["http://127.0.0.1:9"]))))
    return set(route_keys(collector.routes)) | set(route_keys(front.routes))


def opens(tree: ast.AST) -> set[str]:
    """What a module calls that opens a file or a socket."""
    bounded = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
               and node.module == "vramwatch.bounded" for alias in node.names}
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and (func.id in OPENERS or func.id in bounded & {"fetch"}):
                found.add(func.id)
            elif isinstance(func, ast.Attribute) and func.attr in OPENERS:
                found.add(func.attr)
            elif (isinstance(func, ast.Attribute) and func.attr in ("connect", "socket")
                  and isinstance(func.value, ast.Name) and func.value.id in ("sqlite3", "socket")):
                found.add(f"{func.value.id}.{func.attr}")
        elif isinstance(node, ast.Attribute) and node.attr in CONNECTION_CLASSES:
            found.add(node.attr)
    return found


def readers(package: Path, root: Path) -> set[str]:
    return {path.relative_to(root).as_posix() for path in sorted(package.rglob("*.py"))
            if opens(ast.parse(path.read_text(encoding="utf-8")))}


def _is_env(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id in ("env", "environ")) or (
        isinstance(node, ast.Attribute) and node.attr == "environ")


def env_names(tree: ast.AST) -> set[str]:
    """Variable names read from ``os.environ`` (or an ``env`` mapping standing for it)."""
    out: set[str] = set()
    for node in ast.walk(tree):
        args: list[ast.expr] = []
        if isinstance(node, ast.Call):
            func = node.func
            getter = isinstance(func, ast.Attribute) and func.attr in ("get", "pop", "setdefault") and _is_env(
                func.value)
            if getter or (isinstance(func, ast.Attribute) and func.attr == "getenv"):
                args = node.args[:1]
            elif node.args and _is_env(node.args[0]):  # helper(env, "RANK", "SLURM_PROCID")
                args = node.args[1:]
        elif isinstance(node, ast.Subscript) and _is_env(node.value):
            args = [node.slice]
        elif isinstance(node, ast.Compare) and any(_is_env(c) for c in node.comparators):
            args = [node.left]
        out |= {a.value for a in args if isinstance(a, ast.Constant) and isinstance(a.value, str)}
    return out


def code_env_names() -> set[str]:
    from vramwatch.config import ENV

    names = {var.name for var in ENV}
    for path in (ROOT / "vramwatch").rglob("*.py"):
        names |= env_names(ast.parse(path.read_text(encoding="utf-8")))
    return names


def test_every_route_of_the_collector_and_the_front_has_a_row() -> None:
    routes, doc = app_routes(), documented()
    assert sorted(routes - doc) == [], "routes without an inventory row in docs/reliability.md"
    stale = {name for name in doc if re.fullmatch(r"(GET|POST|PUT|PATCH|DELETE) /\S*", name)} - routes
    assert sorted(stale) == [], "inventory rows for routes that no longer exist"


def test_every_module_that_opens_a_file_or_a_socket_has_a_row() -> None:
    found, doc = readers(ROOT / "vramwatch", ROOT), documented()
    assert sorted(found - doc) == [], "modules that open files or sockets without an inventory row"
    stale = {name for name in doc if name.startswith("vramwatch/") and not (ROOT / name).exists()}
    assert sorted(stale) == [], "inventory rows for modules that no longer exist"


def test_every_environment_variable_read_has_a_row() -> None:
    names, doc = code_env_names(), documented()
    assert len(names) > 20
    assert sorted(names - doc) == [], "environment variables without an inventory row"


def test_the_scanners_see_a_new_reader_route_and_variable(tmp_path) -> None:
    """The guards can fail: a module that opens a file, an env read through a helper, and a
    route added to an app are each found."""
    from fastapi import FastAPI

    package = tmp_path / "pkg"
    package.mkdir()
    (package / "quiet.py").write_text("def f(x):\n    return x + 1\n")
    (package / "reader.py").write_text("import gzip\n\ndef f(p):\n    return gzip.open(p).read()\n")
    (package / "client.py").write_text("import http.client\n\ncls = http.client.HTTPSConnection\n")
    assert readers(package, tmp_path) == {"pkg/reader.py", "pkg/client.py"}
    tree = ast.parse("import os\nenv = os.environ\nx = os.environ.get('A_B')\ny = _int(env, 'C_D', 'E_F')\n"
                     "z = 'G_H' in env\nw = os.environ['I_J']\n")
    assert env_names(tree) == {"A_B", "C_D", "E_F", "G_H", "I_J"}
    app = FastAPI()
    app.add_api_route("/api/v1/new/{run:path}/thing", lambda: None, methods=["POST"])
    assert "POST /api/v1/new/{run}/thing" in set(route_keys(app.routes))
    assert "POST /api/v1/new/{run}/thing" not in documented()
