"""Shared fixtures. Test helpers (``helpers``, ``fakes``, ``prometheus_helpers``) import as
top-level modules: pytest's default ``prepend`` import mode puts this directory on
``sys.path`` (there is no ``tests/__init__.py``), so nothing here edits ``sys.path``."""

import pytest


@pytest.fixture(scope="module")
def module_collector(tmp_path_factory: pytest.TempPathFactory):
    """A real collector (uvicorn + SQLite on disk) shared by one test module; ``.db`` is its file."""
    from vramwatch.collector.server import BackgroundServer

    db = tmp_path_factory.mktemp("collector") / "vw.db"
    with BackgroundServer(str(db)) as server:
        server.db = db
        yield server
