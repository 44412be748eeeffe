"""The federating front over several collectors (shards): ``vramwatch serve --peers ...``.

``peers`` (where the shards are) → ``fanout`` (concurrent, bounded, cached GETs) →
``merge`` (pure merging rules) → ``app`` (the FastAPI app serving the dashboard and API).
"""

from vramwatch.front.app import FrontSettings, create_front_app
from vramwatch.front.peers import Peer, PeerError, PeerSource, parse_peers

__all__ = ["FrontSettings", "Peer", "PeerError", "PeerSource", "create_front_app", "parse_peers"]
