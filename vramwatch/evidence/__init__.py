"""Evidence for an operator after the fact: what a rank's allocator held, and how each rank ended.

- ``allocator_history`` (hook side): torch's allocator history recording
  (``_record_memory_history``), bounded, switched on and off.
- ``capture`` (hook side): acts on the collector's capture directives and on an OOM: snapshot,
  gzip, upload off the training thread.
- ``postmortem`` (collector, CLI, report): how each rank of a run ended (exit, OOM, killed,
  silent) and what its memory did before.

The collector stores and serves snapshots (``vramwatch.collector.snapshots.directives``); the CLI's
``capture`` and ``postmortem`` commands are ``vramwatch.cli.evidence``.
"""
