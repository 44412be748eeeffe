"""What a process's last words say killed it: the one classification table.

A process's *last words* are what the hook recorded as it ended: the type and the first line of
the message of an uncaught exception, or the fatal signal ``faulthandler`` wrote down, and the
training-loop phase it was in (:class:`LastWords`). :func:`classify` maps them to a cause of
death, an :class:`~vramwatch.verdicts.Outcome`; the run-life model (:mod:`vramwatch.runlife`)
uses it for a rank's ``died.cause``, the post-mortem's first failure and the incidents.

The table (:data:`RULES`) is checked in order, first match wins, against the exception's type
name (qualified, e.g. ``torch.OutOfMemoryError``) and the message's first line. Each rule names
the documented message it matches:

* PyTorch, CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp): ``torch.OutOfMemoryError``
  (``torch.cuda.OutOfMemoryError`` before 2.5), message "CUDA out of memory. Tried to allocate
  ..."; older releases raise ``RuntimeError`` with the same message. cuBLAS/cuDNN report a failed
  workspace allocation as ``CUBLAS_STATUS_ALLOC_FAILED`` / ``CUDNN_STATUS_ALLOC_FAILED``.
* PyTorch, C10_CUDA_CHECK (c10/cuda/CUDAException.cpp): ``RuntimeError`` / ``torch.AcceleratorError``
  "CUDA error: <cudaGetErrorString>", e.g. "an illegal memory access was encountered", "uncorrectable
  ECC error encountered", "device-side assert triggered", "unspecified launch failure"; the CUDA
  runtime's names (cudaErrorIllegalAddress, cudaErrorECCUncorrectable, cudaErrorAssert, ...) and
  "CUDA driver error" from the driver API. "CUDA error: out of memory" (cudaErrorMemoryAllocation
  outside the caching allocator) is an OOM.
* PyTorch, ProcessGroupNCCL's watchdog (torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp):
  "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=..., OpType=...) ran for ...
  milliseconds before timing out", raised as ``torch.distributed.DistBackendError`` (a
  ``RuntimeError`` before 2.1); ``DistNetworkError`` / "Connection reset by peer" on a store or
  socket when the peer rank is gone; Gloo's "Timed out waiting ... for recv"; NCCL's own
  "NCCL communicator was aborted" after a peer failed.
* The interpreter, faulthandler (Python docs, faulthandler): "Fatal Python error: Segmentation
  fault" (also "Bus error", "Aborted", "Floating point exception", "Illegal instruction"): a
  fatal signal; the hook records it as type ``SIGSEGV``/``SIGBUS``/``SIGABRT``/``SIGFPE``/``SIGILL``.
* Signals from outside: ``SIGTERM`` (a launcher such as torchrun or SLURM stopping the job; the
  host's OOM killer sends SIGKILL, which leaves no words) and ``KeyboardInterrupt`` (SIGINT).
* Anything raised inside a checkpoint phase (a phase whose name starts with ``checkpoint``,
  ``ckpt`` or ``save``), e.g. ``OSError: [Errno 28] No space left on device``, is a failed
  checkpoint unless a rule above names a GPU cause.
* Anything else is an ``exception`` (its type says which).

Also here: :func:`killed_by`, which tells the host's OOM killer from a launcher when the host's
memory shows it. Cost: a classification is a handful of substring tests, O(length of the message).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from vramwatch.verdicts import Outcome

#: bounds of what a process may say (the wire's name rule: 1-128 visible characters)
MAX_TYPE = 128
MAX_MESSAGE = 128


class LastWords(NamedTuple):
    """What a process said as it ended (``last_words`` in the API)."""

    type: str  # the exception's qualified type name, or the fatal signal's name (SIGSEGV ...)
    message: str  # the first line of the message, redacted and bounded ("" when none)
    phase: str  # the training-loop phase it was in: "train", "checkpoint", "eval" ...

    def as_dict(self) -> dict[str, str]:
        return {"type": self.type, "message": self.message, "phase": self.phase}


class Rule(NamedTuple):
    cause: Outcome
    types: tuple[str, ...]  # type-name suffixes (case-sensitive: the names are code)
    words: tuple[str, ...]  # message substrings (case-insensitive)
    source: str


RULES: tuple[Rule, ...] = (
    Rule(Outcome.OOM, ("OutOfMemoryError",),
         ("cuda out of memory", "cuda error: out of memory", "cublas_status_alloc_failed", "cudnn_status_alloc_failed",
          "hip out of memory"),
         "PyTorch CUDACachingAllocator: torch.OutOfMemoryError 'CUDA out of memory. Tried to allocate ...'"),
    Rule(Outcome.COLLECTIVE_TIMEOUT, ("DistBackendError", "DistNetworkError", "DistStoreError"),
         ("watchdog caught collective operation timeout", "collective operation timeout", "nccl communicator was "
          "aborted", "nccl timeout", "processgroupnccl", "timed out waiting", "connection reset by peer"),
         "PyTorch ProcessGroupNCCL watchdog: 'Watchdog caught collective operation timeout: WorkNCCL(...) ran for "
         "... milliseconds before timing out' (DistBackendError)"),
    Rule(Outcome.CUDA_ERROR, ("AcceleratorError", "CudaError"),
         ("cuda error", "cuda driver error", "illegal memory access", "ecc error", "device-side assert",
          "unspecified launch failure", "cudaerror", "cublas_status", "cudnn_status", "nccl error",
          "misaligned address", "illegal instruction was encountered"),
         "PyTorch C10_CUDA_CHECK: 'CUDA error: an illegal memory access was encountered' (cudaGetErrorString)"),
    Rule(Outcome.CRASH, ("SIGSEGV", "SIGBUS", "SIGABRT", "SIGFPE", "SIGILL"),
         ("fatal python error",),
         "Python faulthandler: 'Fatal Python error: Segmentation fault' on a fatal signal"),
    Rule(Outcome.KILLED, ("SIGTERM", "SIGKILL", "SIGINT", "KeyboardInterrupt"), (),
         "POSIX signals from outside: a launcher's SIGTERM, an operator's SIGINT"),
)

#: phase names that are a checkpoint: an exception raised there is a failed checkpoint
CHECKPOINT_PHASES = ("checkpoint", "ckpt", "save")

#: the fatal signals faulthandler reports, by the words of its first line ("Fatal Python error: ...")
FATAL_SIGNALS: dict[str, str] = {
    "segmentation fault": "SIGSEGV", "bus error": "SIGBUS", "aborted": "SIGABRT",
    "floating point exception": "SIGFPE", "illegal instruction": "SIGILL",
}


def last_words_of(sample: Mapping[str, Any]) -> LastWords | None:
    """The last words a wire sample carries (the hook's marker fields), None if it carries none."""
    kind = sample.get("last_words_type")
    if not kind:
        return None
    return LastWords(kind, sample.get("last_words_message") or "", sample.get("last_words_phase") or sample["phase"])


def _matches(rule: Rule, words: LastWords, message: str) -> bool:
    type_name = words.type
    if any(type_name == t or type_name.endswith("." + t) for t in rule.types):
        return True
    return any(w in message for w in rule.words)


def classify(words: LastWords) -> Outcome:
    """The cause of death these last words name: the first matching rule of :data:`RULES` (a GPU
    cause, a crash or a signal stays itself wherever it struck); otherwise ``checkpoint_failed``
    inside a checkpoint phase, else ``exception``."""
    message = words.message.lower()
    for rule in RULES:
        if _matches(rule, words, message):
            return rule.cause
    return Outcome.CHECKPOINT_FAILED if is_checkpoint(words.phase) else Outcome.EXCEPTION


def is_checkpoint(phase: str) -> bool:
    """A phase name that means saving state (``checkpoint``, ``ckpt_save``, ``save_model`` ...)."""
    lowered = phase.lower()
    return lowered.startswith(CHECKPOINT_PHASES)


def fatal_signal(first_line: str) -> str | None:
    """The signal name of faulthandler's "Fatal Python error: Segmentation fault" line, else None."""
    lowered = first_line.lower()
    if "fatal python error" not in lowered:
        return None
    for words, name in FATAL_SIGNALS.items():
        if words in lowered:
            return name
    return "SIGABRT"  # a fatal error without a signal (Py_FatalError) aborts the process


#: host memory available under this fraction of the node's at a rank's last sample: the host's
#: OOM killer is the likely killer of a rank killed without last words
HOST_OOM_FRACTION = 0.02


def killed_by(available_bytes: int | None, rss_bytes: int | None) -> str | None:
    """Who killed a process that said nothing: ``"host_oom"`` when its last sample shows the host
    nearly out of memory (available under :data:`HOST_OOM_FRACTION` of available + the rank's own
    resident memory, a lower bound of the node's), ``"launcher"`` when the host had memory to
    spare, None when the host's memory was not measured."""
    if available_bytes is None:
        return None
    node = available_bytes + (rss_bytes or 0)
    if node > 0 and available_bytes < HOST_OOM_FRACTION * node:
        return "host_oom"
    return "launcher"


__all__ = ["CHECKPOINT_PHASES", "FATAL_SIGNALS", "MAX_MESSAGE", "MAX_TYPE", "RULES", "LastWords", "Rule",
           "classify", "fatal_signal", "is_checkpoint", "killed_by", "last_words_of"]
