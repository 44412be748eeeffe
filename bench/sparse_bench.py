"""The trend engine on what dcgm-exporter gives `vramwatch watch`, vs `predict_linear` on the same data.

    .venv/bin/python -m bench.sparse_bench            # writes docs/benchmarks.md "## Sparse samples"
    .venv/bin/python -m bench.sparse_bench --quick    # two scales, no file written

Every corpus trace (tests/corpus.py) is also judged as a source without the hook records it:

* **allocated_only**, **device_used_only** (every training step): the corpus's own variants
  (``corpus.thin``), as in "Trend engine";
* **dcgm 15 s**: one NVML reading per 15 s dcgm-exporter scrape in whole MiB, turned into a
  sample by the Prometheus importer's own conversion (``importers.prometheus.sample_of``:
  FB_USED + FB_FREE + FB_RESERVED, step = the unix second, no incarnation, no phases): exactly
  what ``vramwatch watch`` and ``import --from prometheus`` feed the engine.

The operator rules (``predict_linear(used[10m], 4h) > total`` and ``used > 95 %``) are
bench/engine_bench.py's, evaluated on the same 15 s scrapes. Scoring (recall, false alarms on
non-leaking ranks, alarms before onset, runway left) is engine_bench's ``score``; alarms of the
dcgm engine (steps in seconds) map back to the training step of the scrape.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

from bench.engine_bench import SCRAPE_S, PredictLinearRule, RankOutcome, ThresholdRule, score
from bench.report import table, write_section
from vramwatch import wire
from vramwatch.engine import TrendEngine
from vramwatch.importers.common import MiB
from vramwatch.importers.prometheus import STEP_S, Gpu, sample_of

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from corpus import SCALES, STEPS, make_case, thin

VARIANTS = ("allocated_only", "device_used_only", "dcgm 15 s")
RULES = ("predict_linear", "threshold 95%")
#: dcgm-exporter's FB_RESERVED on an 80 GB A100 (driver reserve, MiB): USED + FREE + RESERVED = total
FB_RESERVED_MIB = 537


def dcgm_sample(sample: dict[str, Any]) -> dict[str, Any]:
    """One scrape of a rank's GPU as dcgm-exporter reports it (whole MiB), converted as watch does."""
    total = sample["total_bytes"] // MiB
    used = min(sample["nvml_used_bytes"] // MiB, total - FB_RESERVED_MIB)  # FB_USED excludes the reserve
    values = {"used": float(used), "free": float(total - used - FB_RESERVED_MIB), "reserved": float(FB_RESERVED_MIB)}
    gpu = Gpu(sample["host"], sample.get("uuid") or f"GPU-{sample['rank']}", sample.get("gpu") or 0)
    return wire.validate(sample_of(gpu, sample["ts"], values, sample["run"], STEP_S))


class _Mapped:
    """An engine whose step is not the training step (dcgm: seconds): events map back."""

    def __init__(self) -> None:
        self.engine = TrendEngine()
        self.keys: list[int] = []
        self.steps: list[int] = []

    def update(self, sample: dict[str, Any], train_step: int) -> list[dict[str, Any]]:
        self.keys.append(sample["step"])
        self.steps.append(train_step)
        return self.engine.update(sample)

    def train_step(self, step: int) -> int:
        i = bisect.bisect_right(self.keys, step) - 1
        return self.steps[max(i, 0)]


def run_rank(case: Any, rank: int) -> dict[str, RankOutcome]:
    """One corpus rank through an engine per variant and the rules on the 15 s scrapes."""
    engines = {name: _Mapped() for name in VARIANTS}
    rules = {"predict_linear": PredictLinearRule(), "threshold 95%": ThresholdRule()}
    alarms: dict[str, list[int]] = {name: [] for name in (*VARIANTS, *RULES)}
    samples = {name: 0 for name in alarms}
    next_scrape = None
    oom_step, last_step = None, 0
    for sample in case.trace(rank):
        if oom_step is None and sample["ooms"]:
            oom_step = sample["step"]
        last_step = step = sample["step"]
        fed = [(name, thin(sample, name)) for name in ("allocated_only", "device_used_only")]
        if sample["phase"] == "train" and sample["nvml_used_bytes"] is not None:
            ts = sample["ts"]
            if next_scrape is None or ts >= next_scrape:
                next_scrape = ts + SCRAPE_S
                fed.append(("dcgm 15 s", dcgm_sample(sample)))
                for name, rule in rules.items():
                    samples[name] += 1
                    if rule.fires(ts, sample["nvml_used_bytes"], sample["total_bytes"]):
                        alarms[name].append(step)
        for name, s in fed:
            if s is None:
                continue
            samples[name] += 1
            mapped = engines[name]
            for event in mapped.update(s, step):
                if event["type"] == "leak":
                    alarms[name].append(mapped.train_step(event["step"]))
    truth = dict(case.truth[rank])
    if truth["leak"] is not None and oom_step is not None:
        truth["leak"] = dict(truth["leak"], oom_step=oom_step)
    total = case.scale.total_bytes
    return {name: RankOutcome(case.name, case.scenario, rank, truth, total, samples[name], last_step,
                              {"engine": alarms[name], "predict_linear": alarms["predict_linear"],
                               "threshold 95%": alarms["threshold 95%"]})
            for name in VARIANTS}


def collect(scales: list[str]) -> dict[str, list[RankOutcome]]:
    out: dict[str, list[RankOutcome]] = {name: [] for name in VARIANTS}
    for scale_name in scales:
        scale = dataclasses.replace(SCALES[scale_name])
        for scenario in STEPS:
            ranks = tuple(range(8)) if scenario == "multi_rank" else None
            case = make_case(scenario, scale, ranks=ranks)
            for rank in case.ranks:
                for name, outcome in run_rank(case, rank).items():
                    out[name].append(outcome)
    return out


def _row(label: str, s: dict[str, Any]) -> tuple[str, ...]:
    return (label, f"{s['recall']:.0%} ({round(s['recall'] * s['leaking'])}/{s['leaking']})",
            f"{s['false']}/{s['clean']}", str(s["early"]), f"{s['runway_mean']:.0%}", f"{s['runway_min']:.0%}")


def per_scenario(outcomes: dict[str, list[RankOutcome]]) -> list[tuple[str, ...]]:
    """Per scenario (all scales): what each detector did, on the dcgm series unless named."""
    rows = []
    for scenario in STEPS:
        row = [scenario]
        for variant, detector in (("allocated_only", "engine"), ("device_used_only", "engine"),
                                  ("dcgm 15 s", "engine"), ("dcgm 15 s", "predict_linear")):
            group = [o for o in outcomes[variant] if o.scenario == scenario]
            leaking = [o for o in group if o.truth["leak"] is not None]
            if leaking:
                found = sum(1 for o in leaking if any(o.truth["leak"]["onset"] <= s <= o.truth["leak"]["oom_step"]
                                                      for s in o.alarms[detector]))
                early = sum(1 for o in leaking if any(s < o.truth["leak"]["onset"] for s in o.alarms[detector]))
                row.append(f"{found}/{len(leaking)} found" + (f", {early} early" if early else ""))
            elif any(o.truth["fragmentation"] is not None for o in group):
                # fragmentation heads for OOM too (device used rises): scored apart, as in engine_bench
                fired = sum(1 for o in group if o.alarms[detector])
                row.append(f"{fired}/{len(group)} alarms (OOM-bound, not scored)")
            else:
                false = sum(1 for o in group if o.alarms[detector])
                row.append("quiet" if not false else f"{false}/{len(group)} false")
        rows.append(tuple(row))
    return rows


def _write_formats(tmp: Path, traces: dict[int, list[dict[str, Any]]]) -> dict[str, Path]:
    """The same training, as each tool would have recorded it."""
    from datetime import UTC, datetime

    from torch.utils.tensorboard import SummaryWriter

    train = {gpu: [s for s in trace if s["phase"] == "train"] for gpu, trace in traces.items()}
    paths = {"jsonl": tmp / "trace.jsonl", "nvidia-smi": tmp / "smi.csv", "wandb": tmp / "wandb.csv",
             "prometheus": tmp / "prom.json", "tensorboard": tmp / "tb"}
    wire.write_file(paths["jsonl"], [s for trace in train.values() for s in trace])
    gpus = sorted(train)
    rows = list(zip(*(train[g] for g in gpus), strict=False))
    with open(paths["nvidia-smi"], "w") as fh:
        fh.write("timestamp, index, uuid, memory.used [MiB], memory.total [MiB]\n")
        for row in rows:
            stamp = datetime.fromtimestamp(row[0]["ts"], UTC).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
            fh.writelines(f"{stamp}, {g}, {s['uuid']}, {s['nvml_used_bytes'] >> 20} MiB, {s['total_bytes'] >> 20} MiB\n"
                          for g, s in zip(gpus, row, strict=True))
    with open(paths["wandb"], "w") as fh:
        columns = [f"system.gpu.{g}.memoryAllocatedBytes,system.gpu.{g}.memoryAllocated" for g in gpus]
        fh.write(",_runtime,_timestamp," + ",".join(columns) + "\n")
        for i, row in enumerate(rows):
            cells = [str(i), str(i), f"{row[0]['ts']:.3f}"]
            for s in row:
                cells += [str(s["nvml_used_bytes"]), f"{100 * s['nvml_used_bytes'] / s['total_bytes']:.6f}"]
            fh.write(",".join(cells) + "\n")
    result = []
    for name, field_ in (("DCGM_FI_DEV_FB_USED", "used"), ("DCGM_FI_DEV_FB_FREE", "free")):
        for g in gpus:
            values = []
            for s in train[g]:
                used = s["nvml_used_bytes"] >> 20
                values.append([s["ts"], str(used if field_ == "used" else (s["total_bytes"] >> 20) - used)])
            result.append({"metric": {"__name__": name, "Hostname": "node", "UUID": train[g][0]["uuid"], "gpu": str(g)},
                           "values": values})
    paths["prometheus"].write_bytes(orjson.dumps({"status": "success",
                                                  "data": {"resultType": "matrix", "result": result}}))
    writer = SummaryWriter(str(paths["tensorboard"]))
    for s in train[gpus[0]]:
        writer.add_scalar("mem-allocated-bytes", s["allocated_bytes"], s["step"])
        writer.add_scalar("mem-reserved-bytes", s["reserved_bytes"], s["step"])
    writer.close()
    return paths


def import_throughput(steps: int, repeats: int) -> list[tuple[str, ...]]:
    """Samples/s of each importer vs reading vramwatch's own JSONL trace in the same run."""
    from vramwatch.importers import ImportOptions, iter_import
    from vramwatch.probe.simulated import simulate_trace

    traces = {g: list(simulate_trace("demo", steps=steps, rank=g, seed=g)) for g in range(8)}
    with tempfile.TemporaryDirectory() as tmp:
        paths = _write_formats(Path(tmp), traces)
        options = ImportOptions(total_bytes=traces[0][0]["total_bytes"])
        readers = {"jsonl": lambda: sum(1 for _ in wire.iter_samples(paths["jsonl"]))}
        for fmt in ("nvidia-smi", "wandb", "prometheus", "tensorboard"):
            readers[fmt] = lambda fmt=fmt: sum(1 for _ in iter_import([str(paths[fmt])], fmt, options))
        rates: dict[str, list[float]] = {name: [] for name in readers}
        counts: dict[str, int] = {}
        for _ in range(repeats):  # round-robin, so a noisy neighbour hits every reader alike
            for name, fn in readers.items():
                started = time.perf_counter()
                counts[name] = fn()
                rates[name].append(counts[name] / (time.perf_counter() - started))
    limit = statistics.median(rates["jsonl"])
    return [(name, f"{counts[name]:,}", f"{statistics.median(r):,.0f}", f"{limit:,.0f}",
             f"{statistics.median(r) / limit:.2f}") for name, r in rates.items() if name != "jsonl"]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.sparse_bench")
    parser.add_argument("--quick", action="store_true", help="two scales, no docs update")
    args = parser.parse_args(argv)
    scales = ["h200", "rtx-24gb"] if args.quick else ["h200", "a100-80gb", "rtx-24gb", "long"]
    started = time.perf_counter()
    outcomes = collect(scales)
    took = time.perf_counter() - started
    dcgm = score(outcomes["dcgm 15 s"])
    rows = [_row("engine", dcgm["engine"])] + [_row(rule, dcgm[rule]) for rule in RULES]
    n = {name: sum(o.samples for o in outcomes[name]) for name in VARIANTS}
    speed = import_throughput(steps=2_000 if args.quick else 10_000, repeats=2 if args.quick else 5)
    body = f"""
What `vramwatch watch` sees: every corpus rank (`tests/corpus.py`, 16 scenarios, multi_rank with 8 ranks;
scales {", ".join(scales)}, one seed; {len(outcomes["dcgm 15 s"])} ranks) scraped every 15 s as dcgm-exporter
reports it (whole MiB, FB_USED + FB_FREE + FB_RESERVED) and converted by the Prometheus importer (device used +
capacity only, step = unix second, no incarnation, no phases); {n["dcgm 15 s"]:,} samples; took {took:.0f} s.
The operator rules run on the same scrapes. Runway left = (OOM step - detection) / (OOM step - onset), a miss
counts 0 %; fragmentation (device growth too) is scored apart, as in "Trend engine".

{table(("detector, dcgm 15 s", "leak recall", "false alarms (non-leaking ranks)",
        "fired before onset (leaking ranks)", "runway left (mean)", "(worst)"), rows)}

Per scenario (all scales; "found" = a leak alarm between onset and OOM), next to the engine on the corpus's
every-step variants (allocated_only: Megatron's scalar; device_used_only: nvidia-smi -l 1 / W&B; their
corpus-wide figures are in "Trend engine"):

{table(("scenario", "engine, allocated_only", "engine, device_used_only", "engine, dcgm 15 s",
        "predict_linear, dcgm 15 s"), per_scenario(outcomes))}

**Importer throughput** (one core; 8 GPUs of the demo scenario recorded as each tool would have, TensorBoard
one rank with Megatron's two memory scalars per step; median of repeats, round-robin). Limit: reading the same
samples from vramwatch's own JSON Lines trace (`wire.iter_samples`: decode + validate) in the same run:

{table(("format", "samples", "samples/s", "JSONL samples/s (limit)", "measured / limit"), speed)}
"""
    print(body)
    if not args.quick:
        write_section("Sparse samples", body, ".venv/bin/python -m bench.sparse_bench")


if __name__ == "__main__":
    main(sys.argv[1:])
