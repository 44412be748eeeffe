"""Allocator snapshots: directives out, uploads in, diffs and leak suspects."""
