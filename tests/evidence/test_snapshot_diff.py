"""Allocation sites from two allocator snapshots, the safe unpickler, and torch's own
``_memory_viz`` on the same fixtures (snapshots in the documented ``Snapshot`` / ``Segment`` /
``Block`` / ``Frame`` shape, built by ``fakes.fake_snapshot.build_snapshot``)."""

from __future__ import annotations

import copyreg
import gzip
import io
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch.cuda._memory_viz as memory_viz
from fakes.fake_snapshot import TORCH_DIR, Alloc, MiB, build_snapshot, frame, user_stack

from vramwatch.evidence import safe_pickle
from vramwatch.evidence.safe_pickle import UnsafePickle
from vramwatch.evidence.snapshot_diff import Site, SnapshotFormatError, diff, render_text

TRAIN = "/home/op/proj/train.py"
MODEL = "/home/op/proj/model.py"
PARAMS = (MODEL, 20, "__init__")
ACTIVATIONS = (MODEL, 41, "forward")
LEAK = (TRAIN, 95, "train_step")
SHRINKING = (TRAIN, 70, "load_batch")


def _allocs(site: tuple[str, int, str], n: int, size: int, state: str = "active_allocated") -> list[Alloc]:
    return [Alloc(size, user_stack(*site), state) for _ in range(n)]


def leaking_pair() -> tuple[dict[str, Any], dict[str, Any]]:
    """Step 100 and step 400 of a run that keeps one 2 MiB tensor per 10 steps at train.py:95.

    Between them: the activations were freed and allocated again (churn: other sizes, other
    addresses, same total), a batch buffer shrank, a few blocks with no stack (allocated
    while history was off) stayed, and the allocator's cache grew by 512 MiB, more than the
    leak itself."""
    old = (_allocs(PARAMS, 40, 4 * MiB) + _allocs(ACTIVATIONS, 24, 8 * MiB) + _allocs(LEAK, 10, 2 * MiB)
           + _allocs(SHRINKING, 8, 3 * MiB) + [Alloc(MiB, []) for _ in range(5)]
           + _allocs(ACTIVATIONS, 2, 512 * 1024, "active_pending_free"))
    new = (_allocs(PARAMS, 40, 4 * MiB) + _allocs(LEAK, 40, 2 * MiB) + _allocs(ACTIVATIONS, 48, 4 * MiB)
           + _allocs(SHRINKING, 2, 3 * MiB) + [Alloc(MiB, []) for _ in range(5)]
           + _allocs(ACTIVATIONS, 2, 512 * 1024, "active_awaiting_free"))
    return (build_snapshot(old, cached_bytes=64 * MiB), build_snapshot(new, cached_bytes=576 * MiB))


def _state_bytes(snap: dict[str, Any], state: str) -> int:
    return sum(b["size"] for s in snap["segments"] for b in s["blocks"] if b["state"] == state)


# ---------------------------------------------------------------- the diff
def test_the_top_site_is_the_leak_exactly_despite_churn_and_cache_growth():
    old, new = leaking_pair()
    result = diff(old, new)
    top = result.sites[0]
    assert top.site == Site(*LEAK)
    assert (top.bytes_old, top.bytes_new, top.bytes_delta) == (20 * MiB, 80 * MiB, 60 * MiB)
    assert (top.blocks_old, top.blocks_new, top.blocks_delta) == (10, 40, 30)
    assert top.stack[0] == f"{TORCH_DIR}/nn/modules/linear.py:125:forward" and f"{TRAIN}:95:train_step" in top.stack
    by_site = {c.site: c for c in result.sites}
    churn = by_site[Site(*ACTIVATIONS)]  # 24 x 8 MiB freed, 48 x 4 MiB allocated: no change in bytes
    assert churn.bytes_delta == 0 and churn.blocks_delta == 24
    assert by_site[Site(*PARAMS)].bytes_delta == 0 and by_site[Site(*PARAMS)].blocks_delta == 0
    assert by_site[Site(*SHRINKING)].bytes_delta == -18 * MiB and result.sites[-1].site == Site(*SHRINKING)
    assert [c.site for c in result.growing()] == [Site(*LEAK)]
    # the cache grew more than the leak, and is reported apart, never as growth
    cached = _state_bytes(new, "inactive") - _state_bytes(old, "inactive")
    assert result.cached.bytes_delta == cached and cached > 7 * top.bytes_delta
    assert all(c.site.file != "" for c in result.sites)
    assert (result.untraced.bytes_old, result.untraced.bytes_new, result.untraced.blocks_delta) == (5 * MiB, 5 * MiB, 0)
    assert result.live.bytes_delta == 60 * MiB - 18 * MiB  # leak + shrink; the awaiting-free blocks are live
    assert result.live.blocks_old == 40 + 24 + 10 + 8 + 5 + 2


def test_json_document_and_top():
    old, new = leaking_pair()
    doc = diff(old, new, top=1).to_dict()
    assert doc["sites_total"] == 4 and len(doc["sites"]) == 1
    site = doc["sites"][0]
    assert {k: site[k] for k in ("file", "line", "function", "bytes_old", "bytes_new", "bytes_delta", "blocks_delta")} \
        == {"file": TRAIN, "line": 95, "function": "train_step", "bytes_old": 20 * MiB, "bytes_new": 80 * MiB,
            "bytes_delta": 60 * MiB, "blocks_delta": 30}
    assert isinstance(site["stack"], list)
    assert doc["cached"]["bytes_delta"] == _state_bytes(new, "inactive") - _state_bytes(old, "inactive")
    text = render_text(diff(old, new, top=2))
    assert f"{TRAIN}:95 in train_step" in text.splitlines()[2] and "+60.0 MiB" in text
    assert "2 more sites" in text and "cached by the allocator" in text


def test_framework_frames_are_skipped_on_request_and_own_frames_always():
    lightning = frame("/opt/venv/lib/python3.11/site-packages/lightning/pytorch/loops/fit_loop.py", 300, "advance")
    ours = frame("/opt/venv/lib/python3.11/site-packages/vramwatch/hook.py", 230, "step")
    stdlib = frame("/usr/lib/python3.11/contextlib.py", 81, "inner")
    stack = [frame(f"{TORCH_DIR}/_tensor.py", 40, "clone"), ours, stdlib, lightning, frame(TRAIN, 95, "train_step")]
    old = build_snapshot([])
    new = build_snapshot([Alloc(2 * MiB, stack)])
    assert diff(old, new).sites[0].site.file.endswith("lightning/pytorch/loops/fit_loop.py")
    assert diff(old, new, skip=["site-packages/lightning/"]).sites[0].site == Site(*LEAK)
    # a checkout folder called vramwatch is not vramwatch: the user's script in it is a site
    mine = frame("/home/op/vramwatch/bench/leak.py", 12, "run")
    assert diff(old, build_snapshot([Alloc(MiB, [mine])])).sites[0].site == Site("/home/op/vramwatch/bench/leak.py",
                                                                                   12, "run")
    # only torch frames: the outermost one is the site (nearest the user's code)
    inner = [frame(f"{TORCH_DIR}/optim/adamw.py", 90, "_init_group"),
             frame(f"{TORCH_DIR}/optim/optimizer.py", 480, "wrapper")]
    assert diff(old, build_snapshot([Alloc(MiB, inner)])).sites[0].site == Site(f"{TORCH_DIR}/optim/optimizer.py",
                                                                                480, "wrapper")
    # native frames of stacks="all" are skipped too
    native = [frame("/pytorch/c10/cuda/CUDACachingAllocator.cpp", 1100, "malloc"), frame("??", 0, "PyEval_EvalFrame"),
              frame(TRAIN, 95, "train_step")]
    assert diff(old, build_snapshot([Alloc(MiB, native)])).sites[0].site == Site(*LEAK)
    with pytest.raises(ValueError, match="skip"):
        diff(old, new, skip=["[unclosed"])


@pytest.mark.parametrize(("mutate", "where"), [
    (lambda s: s.pop("segments"), "segments"),
    (lambda s: s["segments"][0].pop("blocks"), "segments[0]"),
    (lambda s: s["segments"][0]["blocks"][0].update(size="1"), "segments[0].blocks[0]"),
    (lambda s: s["segments"][0]["blocks"][0].update(frames="train.py"), "segments[0].blocks[0].frames"),
    (lambda s: s["segments"][0]["blocks"][0]["frames"][3].pop("line"), "segments[0].blocks[0].frames[3]"),
])
def test_a_snapshot_of_the_wrong_shape_is_named(mutate, where):
    good = build_snapshot(_allocs(LEAK, 2, MiB))
    bad = build_snapshot(_allocs(LEAK, 2, MiB))
    mutate(bad)
    with pytest.raises(SnapshotFormatError) as err:
        diff(good, bad)
    assert str(err.value).startswith(where + ":")


# ---------------------------------------------------------------- torch's own viewer, same fixtures
def test_torchs_memory_viz_accepts_the_fixtures_and_agrees_on_the_numbers(capsys):
    old, new = leaking_pair()
    for snap in (old, new):
        summary = memory_viz.segsum(snap)  # raises AssertionError when a segment's accounting is off
        allocated = sum(b["requested_size"] for s in snap["segments"] for b in s["blocks"]
                        if b["state"] == "active_allocated")
        assert f"total_allocated: {memory_viz.Bytes(allocated)}" in summary
        assert f"segments: {len(snap['segments'])}" in summary
    lines = memory_viz.memory(new, format_flamegraph=lambda text: text).splitlines()
    by_state: dict[str, int] = {}
    for line in lines:
        stack, size = line.rsplit(" ", 1)
        state = stack.split(";")[1]
        by_state[state] = by_state.get(state, 0) + int(size)
    result = diff(old, new)
    assert by_state["active_allocated"] + by_state["active_awaiting_free"] == result.live.bytes_new
    assert by_state["inactive"] == _state_bytes(new, "inactive")
    assert any("train.py:95:train_step" in line for line in lines)
    # torch's compare lists segments that appeared or vanished: growth inside kept segments
    # (the leak's blocks land in segments both snapshots have) is invisible to it
    compared = memory_viz.compare(old["segments"], new["segments"], format_flamegraph=lambda text: text)
    assert "only_after" in compared  # the grown cache's new segment
    leaked_in_new_segments = sum(int(line.rsplit(" ", 1)[1]) for line in compared.splitlines()
                                 if "only_after" in line and "train.py:95:train_step" in line)
    assert leaked_in_new_segments < result.sites[0].bytes_delta
    capsys.readouterr()


# ---------------------------------------------------------------- never unpickle code
class _Reduce:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


def touch(path: str) -> None:
    Path(path).touch()


def hostile_pickles(marker: Path) -> dict[str, bytes]:
    command = f"touch {marker}".encode()
    return {
        "reduce": pickle.dumps(_Reduce(marker)),
        "nested in a snapshot": pickle.dumps({"segments": [{"blocks": [_Reduce(marker)]}]}),
        "protocol 0 GLOBAL": b"cos\nsystem\n(S'" + command + b"'\ntR.",
        "builtins.eval": b"cbuiltins\neval\n(Vopen(" + repr(str(marker)).encode() + b", 'w')\ntR.",
        "INST": b"(S'" + command + b"'\nios\nsystem\n.",
        "persistent id": b"(lp0\nPsomething\na.",
        "gzip": gzip.compress(pickle.dumps(_Reduce(marker))),
    }


def test_a_hostile_pickle_is_refused_and_runs_nothing(tmp_path: Path):
    marker = tmp_path / "pwned"
    for name, data in hostile_pickles(marker).items():
        with pytest.raises(UnsafePickle) as err:
            safe_pickle.load_snapshot(data)
        assert "\n" not in str(err.value), name
        assert not marker.exists(), f"{name}: the pickle ran code"
    pickle.loads(hostile_pickles(marker)["reduce"])  # the control: an ordinary load does run it
    assert marker.exists()


def test_extension_codes_cannot_reach_a_cached_callable(tmp_path: Path):
    """copyreg's extension cache holds objects find_class never sees again: with a registry in
    use, the opcodes are walked first and EXT/REDUCE refused before anything is built."""
    marker = tmp_path / "pwned-ext"
    code = 0x7A11
    copyreg.add_extension(__name__, "touch", code)
    try:
        assert pickle.loads(b"\x80\x02\x83" + code.to_bytes(2, "little") + b".") is touch  # cache primed
        hostile = b"\x80\x02\x83" + code.to_bytes(2, "little") + b"X" + len(str(marker)).to_bytes(4, "little") \
            + str(marker).encode() + b"\x85R."
        with pytest.raises(UnsafePickle, match="opcode EXT2"):
            safe_pickle.loads(hostile)
        assert not marker.exists()
        # plain data still loads on that path
        assert safe_pickle.loads(pickle.dumps({"segments": [], "t": (1, 2.5, None, True)}, protocol=2)) \
            == {"segments": [], "t": (1, 2.5, None, True)}
    finally:
        copyreg.remove_extension(__name__, "touch", code)


def test_bounds_and_shapes():
    snap = build_snapshot(_allocs(LEAK, 3, MiB))
    data = pickle.dumps(snap, protocol=4)
    assert safe_pickle.load_snapshot(data) == snap
    assert safe_pickle.load_snapshot(gzip.compress(data)) == snap
    assert safe_pickle.load_snapshot(io.BytesIO(gzip.compress(data))) == snap
    with pytest.raises(UnsafePickle, match="larger than 1000 bytes"):
        safe_pickle.load_snapshot(data, max_bytes=1000)
    bomb = gzip.compress(b"\0" * (64 * MiB))  # 64 KiB on the wire
    with pytest.raises(UnsafePickle, match="after gzip inflation"):
        safe_pickle.load_snapshot(bomb, max_bytes=MiB)
    with pytest.raises(UnsafePickle, match="not a pickle"):
        safe_pickle.load_snapshot(data[: len(data) // 2])
    with pytest.raises(UnsafePickle, match="not gzip"):
        safe_pickle.load_snapshot(gzip.compress(data)[:100])
    with pytest.raises(UnsafePickle, match="not a snapshot"):
        safe_pickle.load_snapshot(pickle.dumps([1, 2]))
    with pytest.raises(UnsafePickle, match="segments"):
        safe_pickle.load_snapshot(pickle.dumps({"blocks": []}))
