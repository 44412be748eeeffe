"""Hugging Face ``Trainer`` callback: one sample per optimizer step, eval and checkpoint
saves as phases.

.. code-block:: python

    from vramwatch.integrations.transformers import VramwatchCallback
    trainer = Trainer(..., callbacks=[VramwatchCallback(url="http://collector:8765")])

The Trainer has no "save begins" event: ``on_step_end`` (and ``on_epoch_end``) run after
``DefaultFlowCallback`` decided ``control.should_evaluate`` / ``control.should_save``, and
the Trainer then evaluates, then saves. So the callback opens the ``eval`` phase there and
closes it in ``on_evaluate``; it opens ``checkpoint`` when saving is next and closes it in
``on_save``. An ``on_evaluate``/``on_save`` without an opened phase (``trainer.evaluate()``
called by hand, ``save_strategy="best"``) still records one phase sample.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from vramwatch.hook import Monitor, init
from vramwatch.integrations.watching import watch_quietly


class VramwatchCallback(TrainerCallback):
    """``VramwatchCallback(monitor=None, flush_timeout_s=5.0, **init_kwargs)``; see the Lightning twin."""

    def __init__(self, monitor: Monitor | None = None, *, flush_timeout_s: float = 5.0, **init_kwargs: Any) -> None:
        self.monitor = monitor
        self._owns_monitor = monitor is None
        self._init_kwargs = init_kwargs
        self._flush_timeout_s = flush_timeout_s
        self._open: dict[str, Any] = {}

    def _ensure(self, args: Any) -> Monitor:
        if self.monitor is None:
            kwargs = {"rank": int(getattr(args, "process_index", 0)),
                      "local_rank": max(0, int(getattr(args, "local_process_index", 0))),
                      "world_size": int(getattr(args, "world_size", 1))}
            kwargs.update(self._init_kwargs)
            self.monitor = init(**kwargs)
        return self.monitor

    def _begin(self, name: str) -> None:
        if name not in self._open and self.monitor is not None:
            self._open[name] = self.monitor.begin_phase(name)

    def _end(self, name: str) -> None:
        phase = self._open.pop(name, None)
        if phase is not None:
            phase.__exit__(None, None, None)
        elif self.monitor is not None:
            with self.monitor.phase(name):  # no begin seen: a sample covering the time since the last one
                pass

    def _phases_next(self, control: Any) -> None:
        if control.should_evaluate:
            self._begin("eval")
        elif control.should_save:
            self._begin("checkpoint")

    # ------------------------------------------------------------------ events
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # the Trainer passes its model and optimizer: parameters, gradients, optimizer state by category
        watch_quietly(self._ensure(args), kwargs.get("model"), kwargs.get("optimizer"))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._ensure(args).step(state.global_step)
        self._phases_next(control)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._phases_next(control)

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._ensure(args)
        self._end("eval")
        if control.should_save:  # the Trainer saves right after evaluating
            self._begin("checkpoint")

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._ensure(args)
        self._end("checkpoint")

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        for name in list(self._open):
            self._end(name)
        if self.monitor is not None:
            # flush, not close: trainer.evaluate() often follows train() (same incarnation);
            # the monitor closes at exit or with close()
            self.monitor.flush(self._flush_timeout_s)

    def close(self, timeout: float | None = None) -> None:
        """Close the monitor this callback created (flush, spool the rest, stop threads)."""
        if self.monitor is not None and self._owns_monitor:
            self.monitor.close(self._flush_timeout_s if timeout is None else timeout)


__all__ = ["VramwatchCallback"]
