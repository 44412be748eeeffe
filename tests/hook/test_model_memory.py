"""``vw.watch(model, optimizer)``: parameters, gradients and optimizer state counted from real CPU
training loops (tied weights, frozen parts, AdamW, SGD with momentum, optimizers given late),
each category compared with the tensors themselves; sent sparse, only when it changes."""

from __future__ import annotations

import torch

import vramwatch.hook as hook
from vramwatch import wire
from vramwatch.probe.model_memory import ModelMemory, module_activations, runtime_settings

CATEGORIES = ("params_bytes", "grads_bytes", "optimizer_bytes", "params_fp32_bytes")


class TiedLM(torch.nn.Module):
    """An embedding tied to the output head, a frozen block, a buffer, a trainable block."""

    def __init__(self, vocab: int = 50, dim: int = 16) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.frozen = torch.nn.Linear(dim, dim)
        self.block = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))
        self.norm = torch.nn.BatchNorm1d(dim)  # buffers: running mean/var, num_batches_tracked (int64)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight  # tied
        for p in self.frozen.parameters():
            p.requires_grad_(False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.block(self.frozen(self.emb(ids)))))


def by_hand(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """The categories from the tensors, written independently: distinct data pointers."""
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()]}
    params = sum(t.numel() * t.element_size() for t in tensors.values())
    fp32 = sum(t.numel() * t.element_size() for t in tensors.values() if t.dtype == torch.float32)
    grads = sum(p.numel() * 4 for p in {id(p): p for p in model.parameters() if p.requires_grad}.values())
    state = {t.data_ptr(): t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)}
    opt = sum(t.numel() * t.element_size() for t in state.values())
    return {"params_bytes": params, "grads_bytes": grads, "optimizer_bytes": opt, "params_fp32_bytes": fp32}


def train(vw: hook.Monitor, model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        ids = torch.randint(0, 50, (8,))
        loss = torch.nn.functional.cross_entropy(model(ids), ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()  # set_to_none: the gradients are gone at the step boundary
        vw.step(step, tokens=8, seq_len=8 + step % 3)


def samples_of(vw: hook.Monitor) -> list[dict]:
    path = vw.trace_path
    vw.close()
    return [s for s in wire.iter_samples(path) if not s.get("exit")]


def test_tied_frozen_adamw_each_category_is_the_tensors_and_is_sent_when_it_changes(tmp_path, monkeypatch):
    monkeypatch.delenv("VRAMWATCH_URL", raising=False)
    torch.manual_seed(0)
    model = TiedLM()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    vw = hook.init(run="tied", probe="simulated", out_dir=tmp_path)
    vw.watch(model)  # the optimizer comes later
    train(vw, model, optimizer, range(0, 2))
    before_opt = by_hand(model, optimizer)
    vw.watch(optimizer=[optimizer])  # a list
    train(vw, model, optimizer, range(2, 6))
    expected = by_hand(model, optimizer)
    # unfreeze a part, give it to the optimizer: gradients and state grow, and are sent again
    for p in model.frozen.parameters():
        p.requires_grad_(True)
    optimizer.add_param_group({"params": list(model.frozen.parameters())})
    train(vw, model, optimizer, range(6, 9))
    after = by_hand(model, optimizer)
    samples = samples_of(vw)
    sent = [(s["step"], {k: s[k] for k in CATEGORIES if k in s}) for s in samples]
    assert sent[0] == (0, {**before_opt, "optimizer_bytes": 0})  # watched without an optimizer: none
    assert sent[2] == (2, {"optimizer_bytes": expected["optimizer_bytes"]})  # only what changed
    assert all(not fields for step, fields in sent if step not in (0, 2, 6, 7))
    assert {k: v for s in sent for k, v in s[1].items()} == after  # the latest values are the tensors'
    assert after["grads_bytes"] > expected["grads_bytes"] and after["optimizer_bytes"] > expected["optimizer_bytes"]
    # tied weights once: the head's weight is the embedding's
    emb = model.emb.weight.numel() * 4
    untied = sum(p.numel() * 4 for p in model.parameters()) + emb
    assert expected["params_bytes"] < untied + sum(b.numel() * b.element_size() for b in model.buffers())
    # AdamW: two fp32 moments per trainable element plus a step scalar per parameter
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert after["optimizer_bytes"] == sum(2 * p.numel() * 4 + 4 for p in trainable)
    # params_fp32 leaves out the int64 counter of the norm
    assert after["params_bytes"] - after["params_fp32_bytes"] == 8
    assert [s["seq_len"] for s in samples] == [8 + i % 3 for i in range(9)]


def test_sgd_momentum_and_views_of_one_storage_count_once(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(10, 10)
    base = torch.nn.Parameter(torch.randn(2, 32))
    model.a = torch.nn.Parameter(base.data[0])  # two parameters, views of one storage
    model.b = torch.nn.Parameter(base.data[1])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    memory = ModelMemory()
    memory.watch(model, optimizer)
    first = memory.reading()
    (model(torch.randn(3, 10)).sum() + model.a.sum() + model.b.sum()).backward()
    optimizer.step()
    second = memory.reading()
    assert first == {"params_bytes": (110 + 64) * 4, "grads_bytes": (110 + 64) * 4, "optimizer_bytes": 0,
                     "params_fp32_bytes": (110 + 64) * 4}
    # momentum: one buffer per parameter (a gradient each, even for views of one storage)
    assert second == {"optimizer_bytes": (110 + 64) * 4}
    assert memory.reading() is None and memory.counts == 2  # nothing changed: no recount


def test_a_resized_parameter_is_caught_by_the_periodic_recount():
    model = torch.nn.Linear(4, 4)
    memory = ModelMemory(every=5)
    memory.watch(model)
    assert memory.reading()["params_bytes"] == 20 * 4
    with torch.no_grad():
        model.weight.data = torch.zeros(8, 4)
    seen = [memory.reading() for _ in range(5)]
    assert seen[:4] == [None] * 4 and seen[4]["params_bytes"] == 36 * 4


def test_watch_refuses_what_is_not_a_model_or_optimizer_before_training():
    memory = ModelMemory()
    try:
        memory.watch("model")
    except TypeError as exc:
        assert "torch.nn.Module" in str(exc)
    else:
        raise AssertionError("a string was watched")


def test_runtime_settings_name_torch_and_the_allocator_settings(monkeypatch):
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", " expandable_segments:True, max_split_size_mb:128")
    settings = runtime_settings()
    assert settings == {"torch_version": torch.__version__,
                        "alloc_conf": "expandable_segments:True,max_split_size_mb:128"}
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    assert runtime_settings()["alloc_conf"] == "-"


def test_per_module_activations_come_from_torch_s_memory_tracker():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    optimizer = torch.optim.AdamW(model.parameters())
    x = torch.randn(32, 64)

    def one_step() -> None:
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    rows = {r.module: r for r in module_activations(model, one_step, optimizer=optimizer)}
    # the first Linear's output (32 x 256 fp32) is kept for the backward of the ReLU/second Linear
    assert rows["0"].activation_bytes == 32 * 256 * 4
    assert rows["2"].activation_bytes == 32 * 8 * 4
    assert all(r.peak_bytes >= r.activation_bytes for r in rows.values())
