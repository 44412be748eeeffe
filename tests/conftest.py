import sys
from pathlib import Path

import pytest

# tests import their helpers as top-level modules
sys.path.insert(0, str(Path(__file__).parent))



@pytest.fixture(scope="module")
def module_collector(tmp_path_factory: pytest.TempPathFactory):
    """A real collector (uvicorn + SQLite on disk) shared by one test module; ``.db`` is its file."""
    from vramwatch.collector.server import BackgroundServer

    db = tmp_path_factory.mktemp("collector") / "vw.db"
    with BackgroundServer(str(db)) as server:
        server.db = db
        yield server
