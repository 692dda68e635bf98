"""``val/bpb``: a validation pass's nats over the UTF-8 bytes its very targets encode, not the split's mean."""

from __future__ import annotations

import math
import random

import lightning as L
import torch
import torch.nn.functional as F

from k3lit.data import K3DataModule
from k3lit.model import ModelConfig
from k3lit.train.module import K3LitModule


def test_val_bpb_divides_by_the_bytes_of_the_targets_validated(tmp_path):
    """ASCII text, so decoding any run of targets gives exactly the bytes they encode, independent of the byte table
    the module uses. Two kinds of file (words, random digits), so the first blocks' bytes per token differ from the
    whole split's."""
    rng = random.Random(0)
    (tmp_path / "corpus").mkdir()
    for i in range(40):
        if i % 2:
            text = "".join(f"def function_{j}(value):\n    return value\n" for j in range(30))
        else:
            text = "".join(f"x{rng.randrange(10**6)} = {rng.randrange(10**9)}\n" for _ in range(60))
        (tmp_path / "corpus" / f"m{i:02d}.py").write_text(text, encoding="ascii")
    dm = K3DataModule(corpus=str(tmp_path / "corpus"), tokenizer="bpe:300", cache_dir=str(tmp_path / "cache"),
                      seq_len=64, batch_size=3, val_fraction=0.3)
    cfg = ModelConfig(vocab_size=dm.vocab_size, dim=32, n_layers=2, layer_pattern="A", n_heads=2, head_dim=16,
                      mlp_hidden=32, n_experts=0, attnres_block_size=2)
    torch.manual_seed(0)
    module = K3LitModule(cfg)
    trainer = L.Trainer(accelerator="cpu", devices=1, limit_val_batches=4, logger=False, enable_progress_bar=False,
                        enable_model_summary=False)
    logged = trainer.validate(module, datamodule=dm, verbose=False)[0]

    nats, n_bytes = 0.0, 0
    with torch.no_grad():
        for batch in list(dm.val_dataloader())[:4]:
            nats += float(F.cross_entropy(module.model(batch[:, :-1])[0].flatten(0, 1).float(),
                                          batch[:, 1:].flatten(), reduction="sum"))
            n_bytes += sum(len(dm.tokenizer.decode(row[1:].tolist()).encode("utf-8")) for row in batch)
    assert module.last_val_bytes == n_bytes
    assert math.isclose(logged["val/bpb"], nats / math.log(2) / n_bytes, rel_tol=1e-5)
    # the split's mean bytes per token would have read otherwise (these blocks: 2.23 bytes/token, the split: 1.86)
    assert abs(n_bytes / (4 * 3 * 64) / dm.val_bytes_per_token - 1) > 0.1
