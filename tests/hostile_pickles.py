"""Snapshot pickles as an attacker writes them (the tests and bench/attack_bench.py use these):
each is small on the wire and, read by an unbudgeted unpickler or diff, costs a crash, memory
or minutes."""

from __future__ import annotations

import gzip
import pickle

TORCH_FILE = "/opt/venv/lib/python3.11/site-packages/torch/nn/modules/module.py"


def deep_tuple_key(depth: int = 1_000_000) -> bytes:
    """A dict whose key is a tuple nested ``depth`` deep: hashing it overflows the C stack."""
    return gzip.compress(b"\x80\x04}" + b")" + b"\x85" * depth + b"Ns.", 9)


def memo_index(index: int = 2**26) -> bytes:
    """9 bytes: LONG_BINPUT at ``index`` (the C unpickler sizes its memo table to it)."""
    return b"\x80\x04N" + b"r" + index.to_bytes(4, "little") + b"."


def dup_bomb(dups: int = 64_000_000) -> bytes:
    """A list of ``dups`` references made by DUP (8 bytes of stack and list per byte)."""
    return gzip.compress(b"\x80\x04](N" + b"2" * dups + b"e.", 9)


def shared_blocks(blocks: int = 2_000_000, frames: int = 256) -> bytes:
    """One block dict (its frames: ``frames`` torch frames) shared ``blocks`` times by the memo."""
    frame = {"filename": TORCH_FILE, "line": 1, "name": "forward"}
    block = {"size": 512, "state": "active_allocated", "frames": [frame] * frames}
    return gzip.compress(pickle.dumps({"segments": [{"blocks": [block] * blocks}]}, protocol=4), 9)


def distinct_frame_lists(blocks: int = 200_000, frames: int = 256) -> bytes:
    """``blocks`` frame lists of their own, each ``frames`` torch frames deep (a diff reads them all)."""
    frame = {"filename": TORCH_FILE, "line": 1, "name": "forward"}
    return gzip.compress(pickle.dumps({"segments": [{"blocks": [
        {"size": 512, "state": "active_allocated", "frames": [frame] * frames} for _ in range(blocks)]}]},
        protocol=4), 9)


def mark_bomb(marks: int = 400_000) -> bytes:
    """``marks`` MARKs and nothing else (8 bytes of the unpickler's marks stack per byte)."""
    return gzip.compress(b"\x80\x04N" + b"(" * marks + b".", 9)


def huge_size(bits: int = 1100) -> bytes:
    """A block whose size is 2^``bits`` (LONG4: the integer is built before anything checks it)."""
    return pickle.dumps({"segments": [{"blocks": [{"size": 2**bits, "state": "active_allocated", "frames": []}]}]},
                        protocol=4)


def decimal_size(digits: int = 5000) -> bytes:
    """A block size written as ``digits`` decimal digits (protocol 0's INT opcode)."""
    body = pickle.dumps({"segments": [{"blocks": [{"size": 7, "state": "active_allocated", "frames": []}]}]},
                        protocol=0)
    return body.replace(b"I7\n", b"I" + b"9" * digits + b"\n", 1)


HOSTILE = {
    "deep tuple key": (deep_tuple_key, "depth"),
    "memo index 2^26": (memo_index, "memo"),
    "DUP bomb": (dup_bomb, "dups"),
    "MARK bomb": (mark_bomb, "refs"),
    "block size 2^1100": (huge_size, "int_bytes"),
    "block size 10^5000": (decimal_size, "int_digits"),
}
