"""Lightning and HF Trainer callbacks: real frameworks, real (tiny, random-weight) GPT-2
models built from configs on CPU, random token ids, the simulated probe, a real collector.
Nothing is downloaded (HF_HUB_OFFLINE=1)."""

from __future__ import annotations

import os
import re

import pytest
import torch
from fakes.collector import stored

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _require(module: str):
    if os.environ.get("CI") == "true":
        return __import__(module)  # CI: a missing framework is a failure, not a skip
    return pytest.importorskip(module, reason=f"needs {module}: pip install -e '.[test]'")


@pytest.fixture(scope="module")
def collector(module_collector):
    return module_collector


def latest_categories(db, run: str) -> dict[str, int]:
    """The latest stored value of each category column (sparse: sent when it changes)."""
    import sqlite3

    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    try:
        return {col: con.execute(f"SELECT s.{col} FROM samples s JOIN series se ON s.series = se.id WHERE "
                                 f"se.run = ? AND s.{col} IS NOT NULL ORDER BY s.ts DESC LIMIT 1",
                                 (run,)).fetchone()[0] for col in ("params", "grads", "optimizer")}
    finally:
        con.close()


def categories_by_hand(model, optimizer) -> dict[str, int]:
    """From the tensors: distinct storages of parameters and buffers (GPT-2's head is tied to its
    embedding), fp32 gradients of the trainable ones, every tensor of the optimizer's state."""
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()]}
    state = {t.data_ptr(): t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)}
    return {"params": sum(t.numel() * t.element_size() for t in tensors.values()),
            "grads": sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad),
            "optimizer": sum(t.numel() * t.element_size() for t in state.values())}


def tiny_gpt2():
    transformers = _require("transformers")
    config = transformers.GPT2Config(vocab_size=97, n_positions=32, n_embd=32, n_layer=1, n_head=2)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int = 16, vocab: int = 97) -> None:
        generator = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, vocab, (n, seq), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def test_lightning_callback_feeds_steps_eval_and_checkpoint_phases(collector, tmp_path):
    _require("lightning")
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from vramwatch.integrations.lightning import VramwatchCallback

    class TinyLM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = tiny_gpt2()

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self.model(**batch).loss)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    loader = torch.utils.data.DataLoader(TokenDataset(48), batch_size=4)  # 12 batches per epoch
    callback = VramwatchCallback(url=collector.url, run="lightning-run", probe="simulated",
                                 flush_interval_s=0.05, spool_dir=tmp_path / "spool")
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    trainer = L.Trainer(max_steps=12, val_check_interval=5, limit_val_batches=2, num_sanity_val_steps=1,
                        accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[callback, checkpoints])
    trainer.fit(TinyLM(), loader, loader)
    stats = callback.monitor.stats()
    callback.close()
    rows = stored(collector.db, "lightning-run")
    phases = {}
    for _rank, step, phase, _inc in rows:
        phases.setdefault(phase, []).append(step)
    saved = sorted(int(re.search(r"step=(\d+)", p.name).group(1)) for p in (tmp_path / "ckpt").iterdir())
    assert phases["train"] == list(range(1, 13))  # trainer.global_step after each optimizer step
    assert phases["eval"] == [5, 10]
    assert phases["sanity_check"] == [0]
    assert saved and phases["checkpoint"] == saved  # one phase per checkpoint Lightning wrote
    assert stats["probe_errors"] == stats["hook_errors"] == 0
    assert "save_checkpoint" not in vars(trainer)  # unwrapped at teardown
    # the callback watched the module and its optimizer itself
    lm = trainer.lightning_module
    assert latest_categories(collector.db, "lightning-run") == categories_by_hand(lm, trainer.optimizers[0])
    assert lm.model.lm_head.weight is lm.model.transformer.wte.weight  # tied: counted once above


def test_hf_trainer_callback_feeds_steps_eval_and_checkpoint_phases(collector, tmp_path):
    transformers = _require("transformers")

    from vramwatch.integrations.transformers import VramwatchCallback

    callback = VramwatchCallback(url=collector.url, run="hf-run", probe="simulated", flush_interval_s=0.05,
                                 spool_dir=tmp_path / "spool")
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=12, per_device_train_batch_size=4,
        per_device_eval_batch_size=4, eval_strategy="steps", eval_steps=5, save_strategy="steps", save_steps=4,
        logging_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, dataloader_num_workers=0,
        learning_rate=1e-3,
    )
    class Witness(transformers.TrainerCallback):  # what the Trainer itself says it did
        evaluated: list[int] = []

        def on_evaluate(self, args, state, control, **kwargs):
            self.evaluated.append(state.global_step)

    trainer = transformers.Trainer(model=tiny_gpt2(), args=args, train_dataset=TokenDataset(48),
                                   eval_dataset=TokenDataset(8), callbacks=[callback, Witness()])
    trainer.train()
    stats = callback.monitor.stats()
    callback.close()
    rows = stored(collector.db, "hf-run")
    phases = {}
    for _rank, step, phase, _inc in rows:
        phases.setdefault(phase, []).append(step)
    saved = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "out").glob("checkpoint-*"))
    assert phases["train"] == list(range(1, 13))
    assert Witness.evaluated[:2] == [5, 10] and phases["eval"] == Witness.evaluated  # (+ a final one at 12)
    assert saved == [4, 8, 12] and phases["checkpoint"] == saved
    opened = len(phases["eval"]) + len(phases["checkpoint"])  # each phase is opened by a marker sample
    assert stats["probe_errors"] == stats["hook_errors"] == 0 and stats["accepted"] == len(rows) + opened
    assert latest_categories(collector.db, "hf-run") == categories_by_hand(trainer.model, trainer.optimizer)
