"""What the watched model and optimizer hold, by category, exactly: ``vw.watch(model, optimizer)``.

The categories are counted from the tensors themselves, never estimated:

- ``params_bytes``: every parameter and buffer *storage* once (tied or shared weights, views of one
  buffer: once), ``storage.nbytes()``;
- ``grads_bytes``: what the gradients take when present: every parameter that requires grad (each
  storage once), ``numel x`` its gradient's element size (the gradient's dtype when one exists now,
  else the parameter's: autograd accumulates in the parameter's dtype), so the figure does not
  flicker with ``zero_grad(set_to_none=True)``;
- ``optimizer_bytes``: every tensor in the optimizers' ``state`` (each storage once); frozen
  parameters have none, a lazily-built state (Adam before its first step) counts from the step
  that builds it;
- ``params_fp32_bytes``: the float32 part of ``params_bytes`` (what mixed precision halves).

Cost: a full count walks every parameter, buffer and state tensor (O(tensors), about 1 µs each);
:meth:`ModelMemory.reading` does it only when the optimizers' state grew or shrank (O(optimizers)
per step to notice), or every ``every`` steps (a parameter resized in place), and returns only
the fields that changed (the sample fields are sparse), so an ordinary step costs a few ``len()``.
``bench/hook_bench.py`` measures it against the bare step.

Per-module activations for one step (:func:`module_activations`) use PyTorch's own
``torch.distributed._tools.mem_tracker.MemTracker``; nothing here re-implements it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

#: steps between full recounts when nothing signalled a change (a parameter resized in place)
RECOUNT_EVERY = 200
#: the allocator settings' environment variables, newest name first (torch >= 2.9 reads both)
ALLOC_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
#: what the wire's name kind holds (vramwatch.wire.MAX_NAME)
_MAX_TEXT = 128


@dataclass(frozen=True)
class Categories:
    """One exact count (bytes)."""

    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    params_fp32_bytes: int

    def fields(self) -> dict[str, int]:
        return {"params_bytes": self.params_bytes, "grads_bytes": self.grads_bytes,
                "optimizer_bytes": self.optimizer_bytes, "params_fp32_bytes": self.params_fp32_bytes}


def _storage_key(t: Any) -> tuple[Any, int, int]:
    storage = t.untyped_storage()
    # data_ptr 0 (an empty or meta storage): key by the object so distinct ones are not merged
    ptr = storage.data_ptr()
    return (t.device, ptr if ptr else id(storage), storage.nbytes())


def _on(t: Any, device: Any) -> bool:
    return device is None or t.device == device


def _state_tensors(value: Any, out: list[Any], depth: int = 0) -> None:
    import torch

    if isinstance(value, torch.Tensor):
        out.append(value)
    elif depth < 3 and isinstance(value, dict):
        for v in value.values():
            _state_tensors(v, out, depth + 1)
    elif depth < 3 and isinstance(value, (list, tuple)):
        for v in value:
            _state_tensors(v, out, depth + 1)


def count(models: Iterable[Any], optimizers: Iterable[Any], device: Any = None) -> Categories:
    """The exact categories of ``models`` and ``optimizers`` (on ``device``; None: every device).
    O(parameters + buffers + state tensors)."""
    import torch

    seen: set[tuple[Any, int, int]] = set()
    params = fp32 = 0
    grad_seen: set[int] = set()  # a parameter object once (views of one storage have a gradient each)
    grads = 0
    for model in models:
        for p in model.parameters():
            if not _on(p, device):
                continue
            key = _storage_key(p)
            if key not in seen:
                seen.add(key)
                params += key[2]
                if p.dtype == torch.float32:
                    fp32 += key[2]
            if p.requires_grad and id(p) not in grad_seen:
                grad_seen.add(id(p))
                g = p.grad
                size = g.element_size() if g is not None else p.element_size()
                grads += p.numel() * size
        for b in model.buffers():
            if not _on(b, device):
                continue
            key = _storage_key(b)
            if key not in seen:
                seen.add(key)
                params += key[2]
                if b.dtype == torch.float32:
                    fp32 += key[2]
    state_seen: set[tuple[Any, int, int]] = set()
    opt = 0
    for optimizer in optimizers:
        tensors: list[Any] = []
        for state in optimizer.state.values():
            _state_tensors(state, tensors)
        for t in tensors:
            if not _on(t, device):
                continue
            key = _storage_key(t)
            if key not in state_seen:
                state_seen.add(key)
                opt += key[2]
    return Categories(params, grads, opt, fp32)


class ModelMemory:
    """The watched models and optimizers of one monitor (training thread only)."""

    def __init__(self, device: Any = None, every: int = RECOUNT_EVERY) -> None:
        self.device = device
        self.every = max(1, int(every))
        self.models: list[Any] = []
        self.optimizers: list[Any] = []
        self._signature: tuple[int, ...] | None = None
        self._since = 0
        self._sent: dict[str, int] = {}
        self.latest: Categories | None = None
        self.counts = 0  # full counts done (stats)

    @classmethod
    def for_probe(cls, probe: Any) -> ModelMemory:
        """Counting the tensors on the torch probe's GPU; on every device for other probes (simulated)."""
        index = getattr(probe, "device", None) if getattr(probe, "name", "") == "torch" else None
        if index is None:
            return cls()
        import torch

        return cls(device=torch.device("cuda", int(index)))

    def watch(self, model: Any = None, optimizer: Any = None) -> None:
        """Add a model (or a list of them) and an optimizer (or a list); either may come later."""
        for m in _as_list(model):
            if not callable(getattr(m, "parameters", None)):
                raise TypeError(f"watch: model must be a torch.nn.Module, got {type(m).__name__}")
            if all(m is not known for known in self.models):
                self.models.append(m)
        for o in _as_list(optimizer):
            if not isinstance(getattr(o, "state", None), dict):
                raise TypeError(f"watch: optimizer must be a torch.optim.Optimizer, got {type(o).__name__}")
            if all(o is not known for known in self.optimizers):
                self.optimizers.append(o)
        self._signature = None  # recount at the next step

    def _current_signature(self) -> tuple[int, ...]:
        # what changes when a state is built or dropped, a parameter group added, a model added
        return (len(self.models), *(len(o.state) for o in self.optimizers),
                *(len(o.param_groups) for o in self.optimizers))

    def reading(self) -> dict[str, int] | None:
        """The fields that changed since the last sample, or None (O(optimizers) unless a recount is due)."""
        if not self.models and not self.optimizers:
            return None
        signature = self._current_signature()
        self._since += 1
        if signature == self._signature and self._since < self.every:
            return None
        self._signature, self._since = signature, 0
        self.latest = count(self.models, self.optimizers, self.device)
        self.counts += 1
        out = {k: v for k, v in self.latest.fields().items() if self._sent.get(k) != v}
        self._sent.update(out)
        return out or None

    def resend(self) -> None:
        """Send every field again with the next reading (a new process of the rank; a reconnect)."""
        self._sent.clear()
        self._signature = None


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def runtime_settings() -> dict[str, str]:
    """torch's version and the caching allocator's settings as the process started with them
    (``alloc_conf`` ``-`` when unset): what decides whether ``expandable_segments`` may be advised."""
    out: dict[str, str] = {}
    torch = sys.modules.get("torch")  # never imported here: a simulated probe's process may not want torch
    version = getattr(torch, "__version__", None)
    if version:
        out["torch_version"] = str(version)[:_MAX_TEXT]
    conf = next((os.environ[v] for v in ALLOC_CONF_VARS if os.environ.get(v)), "")
    pairs = [p.strip().replace(" ", "") for p in conf.split(",") if p.strip()]
    text = ""
    for pair in pairs:  # cut at a whole setting, never inside one
        if len(text) + len(pair) + 1 > _MAX_TEXT:
            break
        text = f"{text},{pair}" if text else pair
    out["alloc_conf"] = "".join(ch for ch in text if ch.isprintable()) or "-"
    return out


# ---------------------------------------------------------------------- per module, one step


@dataclass(frozen=True)
class ModuleActivations:
    """One module's activations and its peak during one step, as PyTorch's MemTracker counted them."""

    module: str  # its qualified name ("" for the root)
    activation_bytes: int  # activation memory it added during its forward (post - pre forward)
    peak_bytes: int  # the tracker's peak while it ran (forward or backward), every category
    device: str


def module_activations(model: Any, run_step: Callable[[], object], *, optimizer: Any = None,
                       depth: int = 2) -> list[ModuleActivations]:
    """Run ``run_step()`` once (one forward and backward, optionally the optimizer step) under
    ``torch.distributed._tools.mem_tracker.MemTracker`` and return, per module down to ``depth``,
    the activations its forward added and its peak, largest first. Costs one step under a
    dispatch mode (several times a plain step's time): call it on request, not every step."""
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType, _ModState

    tracker = MemTracker()
    tracker.track_external(*(x for x in (model, optimizer) if x is not None))
    with tracker:
        run_step()
    names = {m: name for name, m in model.named_modules()}
    act = _MemRefType.ACT
    out: list[ModuleActivations] = []
    for module, stats in tracker.memory_tracking.items():
        name = names.get(module)
        if name is None or (name and name.count(".") + 1 > depth):
            continue
        snaps = stats.snapshots
        pre = snaps.get(_ModState.PRE_FW, [])
        post = snaps.get(_ModState.POST_FW, [])
        for device, after in (post[-1].items() if post else ()):
            before = pre[-1].get(device, {}) if pre else {}
            added = int(after.get(act, 0)) - int(before.get(act, 0))
            peak = int(stats.local_peak.get(device, 0))
            out.append(ModuleActivations(name, max(0, added), peak, str(device)))
    out.sort(key=lambda r: (-r.activation_bytes, r.module))
    return out


__all__ = ["ALLOC_CONF_VARS", "RECOUNT_EVERY", "Categories", "ModelMemory", "ModuleActivations", "count",
           "module_activations", "runtime_settings"]
