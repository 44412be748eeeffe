"""Framework callbacks: thin wrappers over :class:`vramwatch.hook.Monitor`.

* :mod:`vramwatch.integrations.lightning` — ``VramwatchCallback`` for (PyTorch) Lightning
* :mod:`vramwatch.integrations.transformers` — ``VramwatchCallback`` for the HF ``Trainer``

Each module imports its framework only when imported itself, so ``import vramwatch``
never pulls Lightning or transformers in.
"""
