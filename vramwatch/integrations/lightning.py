"""Lightning callback: one sample per optimizer step, checkpoints and validation as phases.

.. code-block:: python

    from vramwatch.integrations.lightning import VramwatchCallback
    trainer = L.Trainer(callbacks=[VramwatchCallback(url="http://collector:8765")])

* train steps: ``on_train_batch_end`` with ``trainer.global_step`` (optimizer steps; with
  gradient accumulation only the batch that completes a step is recorded);
* ``checkpoint`` phase: around ``trainer.save_checkpoint`` (state-dict gathering *and*
  writing, on every rank; ``on_save_checkpoint`` alone fires before the write);
* ``eval`` phase: ``on_validation_start`` → ``on_validation_end`` (the sanity check is
  recorded as ``sanity_check``);
* teardown / exception: open phases are closed and the monitor flushed; it closes at
  exit (or ``callback.close()``).

Rank, local rank and world size come from the trainer. Works with ``lightning`` and with
the older ``pytorch_lightning`` package.
"""

from __future__ import annotations

from typing import Any

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # pragma: no cover - the pre-2.0 package name
    from pytorch_lightning.callbacks import Callback  # type: ignore[no-redef]

from vramwatch.hook import Monitor, init
from vramwatch.integrations.watching import watch_quietly


class VramwatchCallback(Callback):
    """``VramwatchCallback(monitor=None, flush_timeout_s=5.0, **init_kwargs)``.

    Pass a ready :class:`Monitor`, or the keyword arguments of :func:`vramwatch.init`
    (``url=``, ``probe=``, ``run=`` ...) and the callback creates one at ``setup``.
    """

    def __init__(self, monitor: Monitor | None = None, *, flush_timeout_s: float = 5.0, **init_kwargs: Any) -> None:
        self.monitor = monitor
        self._owns_monitor = monitor is None
        self._init_kwargs = init_kwargs
        self._flush_timeout_s = flush_timeout_s
        self._last_step: int | None = None
        self._eval_phase: Any = None
        self._wrapped_trainer: Any = None

    # ------------------------------------------------------------------ lifecycle
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self.monitor is None:
            kwargs = {"rank": trainer.global_rank, "local_rank": trainer.local_rank,
                      "world_size": trainer.world_size}
            kwargs.update(self._init_kwargs)
            self.monitor = init(**kwargs)
        self._wrap_save_checkpoint(trainer)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._end_eval()
        self._unwrap_save_checkpoint()
        if self.monitor is not None:
            # flush, not close: fit() is often followed by validate()/test() (same incarnation);
            # the monitor closes at exit or with close()
            self.monitor.flush(self._flush_timeout_s)

    def close(self, timeout: float | None = None) -> None:
        """Close the monitor this callback created (flush, spool the rest, stop threads)."""
        if self.monitor is not None and self._owns_monitor:
            self.monitor.close(self._flush_timeout_s if timeout is None else timeout)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._end_eval()
        if self.monitor is not None:
            self.monitor.flush(self._flush_timeout_s)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # the optimizers exist now (configure_optimizers ran): parameters, gradients, optimizer state
        watch_quietly(self.monitor, pl_module, list(getattr(trainer, "optimizers", None) or ()))

    # ------------------------------------------------------------------ steps
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if self.monitor is not None and step != self._last_step:
            self._last_step = step
            self.monitor.step(step)

    # ------------------------------------------------------------------ phases
    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if self.monitor is not None and self._eval_phase is None:
            name = "sanity_check" if getattr(trainer, "sanity_checking", False) else "eval"
            self._eval_phase = self.monitor.begin_phase(name)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self._end_eval()

    def _end_eval(self) -> None:
        phase, self._eval_phase = self._eval_phase, None
        if phase is not None:
            phase.__exit__(None, None, None)

    def _wrap_save_checkpoint(self, trainer: Any) -> None:
        if self._wrapped_trainer is trainer:
            return
        original = trainer.save_checkpoint
        callback = self

        def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
            monitor = callback.monitor
            if monitor is None:
                return original(*args, **kwargs)
            with monitor.phase("checkpoint"):
                return original(*args, **kwargs)

        trainer.save_checkpoint = save_checkpoint  # instance attribute: shadows the method
        self._wrapped_trainer = trainer

    def _unwrap_save_checkpoint(self) -> None:
        trainer, self._wrapped_trainer = self._wrapped_trainer, None
        if trainer is not None and "save_checkpoint" in vars(trainer):
            del trainer.save_checkpoint


__all__ = ["VramwatchCallback"]
