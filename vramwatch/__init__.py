"""vramwatch: live GPU-memory telemetry for deep-learning training.

Public surface (the rank-local hook)::

    import vramwatch
    vw = vramwatch.init(url="http://collector:8765")
    for step, batch in enumerate(loader):
        ...
        vw.step(step)
        with vw.phase("checkpoint"):
            save(...)
    vw.close()
"""

from vramwatch.__about__ import __version__
from vramwatch.wire import SCHEMA_VERSION, Sample, WireError

__all__ = ["SCHEMA_VERSION", "Sample", "WireError", "__version__"]

try:  # the hook lands with the probe/delivery modules
    from vramwatch.hook import Monitor, init

    __all__ += ["Monitor", "init"]
except ImportError:  # pragma: no cover
    pass
