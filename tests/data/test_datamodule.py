import math

import lightning as L
import pytest
import torch
from litdata import StreamingDataLoader

from k3lit.data.datamodule import K3DataModule


def _dm(corpus, cache, **kw):
    args = dict(corpus=str(corpus), cache_dir=str(cache), seq_len=16, batch_size=4, val_fraction=0.25)
    return K3DataModule(**{**args, **kw})


def test_vocab_size_known_before_prepare(tmp_path, text_corpus):
    assert _dm(text_corpus, tmp_path / "c").vocab_size == 257
    assert _dm(text_corpus, tmp_path / "c", tokenizer="bpe:1000").vocab_size == 1000
    assert not (tmp_path / "c").exists()  # nothing was prepared


def test_batches_shape_dtype_and_bits_per_byte(tmp_path, text_corpus):
    dm = _dm(text_corpus, tmp_path / "c")
    dm.prepare_data()
    dm.setup("fit")
    train, val = dm.train_dataloader(), dm.val_dataloader()
    assert isinstance(train, StreamingDataLoader) and isinstance(val, StreamingDataLoader)
    batches = list(train)
    assert len(batches) == len(train) > 2
    assert all(b.dtype == torch.long and b.shape == (4, 17) for b in batches)
    assert all(0 <= int(b.min()) and int(b.max()) < dm.vocab_size for b in batches)
    vb = list(val)
    assert vb and all(b.dtype == torch.long and b.shape[1] == 17 and b.shape[0] <= 4 for b in vb)
    assert math.isclose(
        dm.val_bytes_per_token,
        dm.prepared.meta["splits"]["val"]["n_bytes"] / dm.prepared.meta["splits"]["val"]["n_tokens"],
    )
    assert 0.9 < dm.val_bytes_per_token < 1.0
    # seeded shuffle: same seed, same order; other seed, other order
    again = next(iter(_dm(text_corpus, tmp_path / "c").train_dataloader()))
    other = next(iter(_dm(text_corpus, tmp_path / "c", seed=7).train_dataloader()))
    assert torch.equal(again, batches[0]) and not torch.equal(other, batches[0])


def test_bpe_datamodule_tokenizer(tmp_path, text_corpus):
    dm = _dm(text_corpus, tmp_path / "c", tokenizer="bpe:300")
    dm.prepare_data()
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch.shape == (4, 17) and int(batch.max()) < dm.vocab_size
    assert dm.tokenizer.spec == "bpe:300" and dm.val_bytes_per_token > 1.5
    assert "def" in dm.tokenizer.decode(batch.flatten().tolist())


def test_loader_state_dict_resumes_at_next_batch(tmp_path, text_corpus):
    dm = _dm(text_corpus, tmp_path / "c")
    dm.prepare_data()
    loader = dm.train_dataloader()
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = loader.state_dict()
    expected = [next(it) for _ in range(2)]
    fresh = _dm(text_corpus, tmp_path / "c").train_dataloader()
    fresh.load_state_dict(state)
    it2 = iter(fresh)
    got = [next(it2) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_a_checkpoint_under_litdatas_default_window_resumes_its_own_order(tmp_path, text_corpus):
    """A loader state saved under litdata's default in-chunk window (256, what k3lit used before asking for a full
    permutation) resumes with that window: the next batches are those the old loader would have given."""
    from litdata import StreamingDataset
    from litdata.streaming.item_loader import TokensLoader

    from k3lit.data.datamodule import collate_tokens

    dm = _dm(text_corpus, tmp_path / "c")
    dm.prepare_data()
    old = StreamingDataLoader(
        StreamingDataset(str(dm.prepared.split_dir("train")), item_loader=TokensLoader(block_size=17), shuffle=True,
                         seed=dm.seed, drop_last=True),
        batch_size=4, collate_fn=collate_tokens, drop_last=True)
    it = iter(old)
    for _ in range(3):
        next(it)
    state = old.state_dict()
    assert state["dataset"]["item_shuffle_window"] == 256
    expected = [next(it) for _ in range(2)]
    fresh = dm.train_dataloader()
    fresh.load_state_dict(state)
    got = [b for _, b in zip(range(2), fresh)]
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_each_batch_draws_from_the_whole_chunk(stdlib_prepared):
    """Training blocks are a full random permutation of each chunk's: a batch's 16 blocks span the chunk, not one
    window of 256 consecutive blocks (a few neighbouring files), and consecutive batches differ in where they read."""
    import hashlib

    import numpy as np
    from litdata import StreamingDataset
    from litdata.streaming.item_loader import TokensLoader

    dm = K3DataModule(cache_dir=str(stdlib_prepared.root.parent), seq_len=256, batch_size=16)
    flat = StreamingDataset(str(dm.prepared.split_dir("train")), item_loader=TokensLoader(block_size=257))
    where = {hashlib.sha1(np.asarray(flat[i]).tobytes()).digest(): i for i in range(len(flat))}
    batches = [[where[hashlib.sha1(row.numpy().astype(np.uint16).tobytes()).digest()] for row in b]
               for _, b in zip(range(16), dm.train_dataloader())]
    spans = sorted(max(b) - min(b) for b in batches)
    assert len(flat) > 20 * 256 and spans[len(spans) // 2] > 10 * 256, (len(flat), spans)


class _Recorder(L.LightningModule):
    """Records every training batch; one parameter so the optimizer has something to step."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch.clone())
        return (self.w * batch.float().mean()).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _trainer(root, max_steps, **kw):
    return L.Trainer(
        default_root_dir=root,
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        **kw,
    )


@pytest.mark.parametrize("num_workers", [0, 2])
def test_lightning_checkpoint_resumes_data_position(tmp_path, text_corpus, num_workers):
    """A run resumed from a step-3 checkpoint sees exactly the batches 4.. of the uninterrupted run."""
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    full = _Recorder()
    _trainer(tmp_path, 7, callbacks=[ckpt]).fit(
        full, datamodule=_dm(text_corpus, tmp_path / "c", num_workers=num_workers)
    )
    assert len(full.seen) == 7
    state = torch.load(tmp_path / "ckpt" / "epoch=0-step=3.ckpt", weights_only=False)
    assert state["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["num_samples_yielded"] == 3 * 4

    resumed = _Recorder()
    _trainer(tmp_path, 7).fit(
        resumed,
        datamodule=_dm(text_corpus, tmp_path / "c", num_workers=num_workers),
        ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=3.ckpt"),
    )
    assert len(resumed.seen) == 4
    assert all(torch.equal(a, b) for a, b in zip(resumed.seen, full.seen[3:]))


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"seq_len": 0}, "seq_len=0 must be an integer >= 1"),
        ({"batch_size": 0}, "batch_size=0"),
        ({"num_workers": -1}, "num_workers=-1"),
        ({"val_fraction": 1.0}, r"val_fraction=1.0 must be in \(0, 1\)"),
        ({"tokenizer": "gpt2"}, "Unknown tokenizer spec"),
        ({"corpus": ""}, "`corpus` is empty"),
    ],
)
def test_bad_arguments(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        K3DataModule(**{"cache_dir": str(tmp_path), **kw})


def test_missing_and_empty_corpus(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        K3DataModule(corpus=str(tmp_path / "nope"), cache_dir=str(tmp_path / "c")).prepare_data()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no non-empty"):
        K3DataModule(corpus=str(tmp_path / "empty"), cache_dir=str(tmp_path / "c")).prepare_data()
    with pytest.raises(FileNotFoundError, match="Tokenizer file"):
        K3DataModule(tokenizer=str(tmp_path / "tok.json"), cache_dir=str(tmp_path / "c"))


def test_seq_len_longer_than_val_split(tmp_path, text_corpus):
    dm = _dm(text_corpus, tmp_path / "c", seq_len=100_000)
    dm.prepare_data()
    with pytest.raises(ValueError, match="Lower seq_len"):
        dm.setup("fit")


def test_stdlib_datamodule(stdlib_prepared, tmp_path):
    cache = stdlib_prepared.root.parent
    dm = K3DataModule(cache_dir=str(cache), seq_len=64, batch_size=8)
    dm.prepare_data()
    assert dm.prepared.root == stdlib_prepared.root  # reused, not rebuilt
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch.shape == (8, 65) and batch.dtype == torch.long


def test_describe(tmp_path, text_corpus):
    text = _dm(text_corpus, tmp_path / "c").describe()
    assert "tokenizer: byte (vocab 257, eos 256)" in text and "train:" in text and "val:" in text
