"""gpu_watch_check: ``vw.watch`` on a real GPU in under a minute.

A small transformer with tied embeddings and a frozen first layer trains on CUDA for 60 steps with
AdamW through the hook (torch probe, trace files), watched. Checks, every train sample:

  params/grads/optimizer bytes (carried forward) == the CUDA tensors counted by hand (distinct
  storages; the trainable parameters' bytes; every tensor of the optimizer's state)
  activations = peak_allocated - (params + grads + optimizer) >= 0 after the first step

then one step under PyTorch's MemTracker (per-module activations on the device). Prints the
categories of the last step. Exit 0: all hold; 1: some do not; 2: no CUDA device.

    python -m bench.gpu_watch_check [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

import vramwatch
from vramwatch import wire
from vramwatch.probe.model_memory import module_activations


def by_hand(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()] if t.is_cuda}
    state = {t.data_ptr(): t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.is_cuda}
    return {"params_bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
            "grads_bytes": sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad),
            "optimizer_bytes": sum(t.numel() * t.element_size() for t in state.values())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_watch_check: no CUDA device", file=sys.stderr)
        return 2
    out = args.out or Path(tempfile.mkdtemp(prefix="vw-watch-"))
    torch.manual_seed(0)
    vocab, dim = 8192, 512
    emb = torch.nn.Embedding(vocab, dim)
    layers = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(dim, 8, 4 * dim, batch_first=True), 4,
                                         enable_nested_tensor=False)
    head = torch.nn.Linear(dim, vocab, bias=False)
    head.weight = emb.weight  # tied
    model = torch.nn.ModuleDict({"emb": emb, "layers": layers, "head": head}).cuda()
    for p in model["layers"].layers[0].parameters():
        p.requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    def step() -> None:
        ids = torch.randint(0, vocab, (8, 256), device="cuda")
        logits = model["head"](model["layers"](model["emb"](ids)))
        torch.nn.functional.cross_entropy(logits.view(-1, vocab), ids.view(-1)).backward()
        optimizer.step()
        optimizer.zero_grad()

    vw = vramwatch.init(run="gpu-watch-check", probe="torch", out_dir=out)
    vw.watch(model, optimizer)
    for i in range(60):
        step()
        vw.step(i, tokens=8 * 256, seq_len=256)
    expected = by_hand(model, optimizer)
    path = vw.trace_path
    vw.close()
    failures, held = [], {}
    for s in wire.iter_samples(path):
        if s["phase"] != "train" or s.get("exit"):
            continue
        held.update({k: s[k] for k in expected if k in s})
        acts = s["peak_allocated_bytes"] - sum(held.values())
        if s["step"] > 0 and acts < 0:
            failures.append(f"step {s['step']}: activations {acts} < 0")
    if held != expected:
        failures.append(f"categories {held} != the tensors {expected}")
    rows = module_activations(model, step, optimizer=optimizer, depth=2)
    if not rows or rows[0].device != "cuda:0":
        failures.append(f"MemTracker rows on the device: {rows[:3]}")
    print(f"last step: {held}, activations {acts / 2**20:.1f} MiB; top modules: "
          + ", ".join(f"{r.module or '(root)'} {r.activation_bytes / 2**20:.1f} MiB" for r in rows[:4]))
    for f in failures:
        print("FAIL", f)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
