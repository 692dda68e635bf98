"""`k3lit positions`: bits per byte by position bucket, by hand and on a real tiny checkpoint against validation."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from k3lit.cli import main
from k3lit.data.datamodule import K3DataModule
from k3lit.data.tokenizer import ByteTokenizer, train_bpe
from k3lit.train import positions as pos
from k3lit.train.module import K3LitModule

ROOT = Path(__file__).parents[2]
TINY = [
    "--model.dim=32", "--model.n_layers=3", "--model.n_heads=2", "--model.head_dim=16", "--model.mlp_hidden=64",
    "--model.n_experts=4", "--model.top_k=2", "--model.expert_dim=32", "--data.tokenizer=byte", "--data.seq_len=32",
    "--data.batch_size=2", "--trainer.limit_val_batches=1", "--trainer.enable_model_summary=false",
    "--trainer.enable_progress_bar=false",
]
BLOCKS = 3


def test_bucket_edges_and_labels():
    assert pos.bucket_edges(128, 32) == [0, 32, 64, 128]
    assert pos.bucket_edges(100, 32) == [0, 32, 64, 128]
    assert pos.bucket_edges(20, 32) == [0, 32]
    assert pos.bucket_label(2048, 4096) == "2k-4k" and pos.bucket_label(0, 32) == "0-32"
    with pytest.raises(ValueError, match="bucket base >= 1"):
        pos.bucket_edges(128, 0)


def test_bucket_sums_by_hand():
    """Six positions in buckets [0,2), [2,4), [4,8), [8,16): nats in units of ln 2, so bpb = bits / bytes."""
    nats = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]) * math.log(2)
    nbytes = torch.tensor([1, 0, 2, 1, 3, 1])
    sums = pos.bucket_sums(nats, nbytes, [0, 2, 4, 8, 16])
    assert sums[:, 0].tolist() == [2, 2, 2, 0]  # targets
    assert sums[:, 2].tolist() == [1, 3, 4, 0]  # bytes
    bpb = (sums[:3, 1] / math.log(2) / sums[:3, 2]).tolist()
    assert bpb == pytest.approx([3.0, 7 / 3, 11 / 4])
    with pytest.raises(ValueError, match="at least the length 6"):
        pos.bucket_sums(nats, nbytes, [0, 2, 4])


def test_tokens_of_another_tokenizer_are_refused(tmp_path):
    bpe = train_bpe(["def f(x):\n    return x\n"] * 20, 300, tmp_path / "bpe.json")
    pos.check_same_tokenizer(bpe, {"tokenizer_spec": "bpe:300", "tokenizer_json": bpe.path.read_text()})
    with pytest.raises(ValueError, match="not the checkpoint's"):
        pos.check_same_tokenizer(ByteTokenizer(), {"tokenizer_spec": "bpe:300", "tokenizer_json": "{}"})


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory, stdlib_cache) -> Path:
    """A 2-step fit of a narrowed tiny recipe at seq_len 32 on the built-in corpus (byte tokenizer)."""
    root = tmp_path_factory.mktemp("fit")
    main(["fit", "--config", str(ROOT / "recipes" / "tiny.yaml"), *TINY, f"--data.cache_dir={stdlib_cache}",
          f"--trainer.default_root_dir={root}", "--trainer.max_steps=2", "--trainer.val_check_interval=2"])
    return root / "checkpoints" / "last.ckpt"


def test_positions_end_to_end_agrees_with_validate_and_a_direct_forward(tiny_ckpt, stdlib_cache, tmp_path, capsys):
    out_json, out_png = tmp_path / "positions.json", tmp_path / "positions.png"
    main(["positions", "--ckpt", str(tiny_ckpt), "--lengths", "32", "64", "128", "--blocks", str(BLOCKS),
          "--json", str(out_json), "--png", str(out_png)])
    table = capsys.readouterr().out
    report = json.loads(out_json.read_text())
    assert report["edges"] == [0, 32, 64, 128] and report["train_seq_len"] == 32
    rows = {r["length"]: r for r in report["results"]}
    assert sorted(rows) == [32, 64, 128] and all(r["blocks"] == BLOCKS for r in rows.values())
    for length, r in rows.items():  # every bucket the length reaches holds its targets and a finite bpb
        assert [(b["start"], b["end"]) for b in r["buckets"]] == [(0, 32), (32, 64), (64, 128)]
        filled = [b for b in r["buckets"] if b["start"] < length]
        assert sum(b["targets"] for b in filled) == BLOCKS * length
        assert all(math.isfinite(b["bpb"]) and 0 < b["bpb"] < 20 for b in filled)
        assert all(b["bpb"] is None for b in r["buckets"] if b["start"] >= length)
    assert out_png.stat().st_size > 1000
    assert "packed documents joined by eos" in table
    assert [line.split()[:2] for line in table.splitlines() if line.strip().split()[0] in ("32", "64", "128")] == [
        ["32", str(BLOCKS)], ["64", str(BLOCKS)], ["128", str(BLOCKS)]]

    # at the training length: validate's val/loss over the same blocks (one batch of BLOCKS)
    val_root = tmp_path / "val"
    main(["validate", "--config", str(ROOT / "recipes" / "tiny.yaml"), *TINY, f"--data.cache_dir={stdlib_cache}",
          f"--data.batch_size={BLOCKS}", f"--trainer.default_root_dir={val_root}", "--ckpt_path", str(tiny_ckpt)])
    with open(val_root / "metrics.csv") as f:
        header, values = f.read().splitlines()[:2]
    val_loss = float(dict(zip(header.split(","), values.split(",")))["val/loss"])
    assert rows[32]["loss"] == pytest.approx(val_loss, rel=1e-5)

    # and a forward written here: mean cross-entropy per byte, a byte per non-eos target (byte tokenizer)
    ckpt = torch.load(tiny_ckpt, weights_only=False)
    def init_args(hparams: dict) -> dict:  # without Lightning's private entries
        return {k: v for k, v in hparams.items() if not k.startswith("_")}

    module = K3LitModule(**init_args(ckpt["hyper_parameters"]))
    module.load_state_dict(ckpt["state_dict"])
    module.eval()
    dm = K3DataModule(**{**init_args(ckpt["datamodule_hyper_parameters"]), "seq_len": 128, "batch_size": BLOCKS})
    batch = next(iter(dm.val_dataloader()))
    with torch.no_grad():
        nats = F.cross_entropy(module(batch[:, :-1]).transpose(1, 2), batch[:, 1:], reduction="none")
    late = slice(64, 128)  # the bucket [64, 128): positions beyond twice the training length
    late_bytes = (batch[:, 1:][:, late] != 256).sum().item()
    bits = nats[:, late].sum().item() / math.log(2)
    assert rows[128]["buckets"][2]["bpb"] == pytest.approx(bits / late_bytes, rel=1e-5)

    # the same bytes in windows of the training length: four forwards of 32 tokens, each from an empty state
    assert rows[128]["window"] == 32
    with torch.no_grad():
        windowed = torch.cat([F.cross_entropy(module(batch[:, s:s + 32]).transpose(1, 2), batch[:, s + 1:s + 33],
                                              reduction="none") for s in range(0, 128, 32)], dim=1)
    bits_windowed = windowed[:, late].sum().item() / math.log(2)
    assert rows[128]["buckets"][2]["bpb_window"] == pytest.approx(bits_windowed / late_bytes, rel=1e-5)
    assert bits_windowed != pytest.approx(bits, rel=1e-5)  # the longer context changes the late targets' nats
    assert rows[32]["bpb_window"] == rows[32]["bpb"]  # at the training length one window is the whole block
    assert "in 32" in table


def test_a_split_too_small_for_a_length_is_a_clear_error(tiny_ckpt, capsys):
    with pytest.raises(SystemExit) as e:
        main(["positions", "--ckpt", str(tiny_ckpt), "--lengths", "32", "100000000"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "holds no block of 100,000,001 tokens" in err and "drop length 100000000" in err


def test_a_length_shorter_than_the_first_bucket_is_a_clear_error(tiny_ckpt, capsys):
    """Its blocks would fill only part of the bucket the table heads 0-32 (the training length)."""
    for extra, hint in (([], "the training length, --bucket_base by default"),
                        (["--bucket_base", "24"], "--bucket_base")):
        with pytest.raises(SystemExit) as e:
            main(["positions", "--ckpt", str(tiny_ckpt), "--lengths", "16", "64", *extra])
        err = capsys.readouterr().err
        base = 24 if extra else 32
        assert e.value.code == 2 and f"--lengths 16 is shorter than the first position bucket (0-{base}: {hint})" in err
        assert f"pass lengths of at least {base}, or --bucket_base 16" in err


def test_default_lengths_are_1_4_and_16_times_the_training_length(tiny_ckpt, tmp_path):
    main(["positions", "--ckpt", str(tiny_ckpt), "--blocks", "1", "--json", str(tmp_path / "p.json")])
    report = json.loads((tmp_path / "p.json").read_text())
    assert [r["length"] for r in report["results"]] == [32, 128, 512]
    assert report["edges"] == [0, 32, 64, 128, 256, 512]
    assert np.isfinite([r["bpb"] for r in report["results"]]).all()


def test_attention_window_and_logn_scaling_reach_the_model(tiny_ckpt, tmp_path, capsys):
    """``--attn_window`` / ``--attn_logn_base`` at the training length change no bit of the scores (one window
    holds the block; every position is below the base); at 4x they change the softmax layers' reading."""
    runs = {}
    for name, extra in (("as trained", []), ("reach", ["--attn_window", "32", "--attn_logn_base", "32"])):
        out = tmp_path / f"{len(runs)}.json"
        main(["positions", "--ckpt", str(tiny_ckpt), "--lengths", "32", "128", "--blocks", "2", "--json", str(out),
              *extra])
        runs[name] = json.loads(out.read_text())
    table = capsys.readouterr().out
    # the reading's changes follow "as in training", which describes the packing only
    assert ("as in training; softmax attention over the last 32 tokens; queries scaled by log-n beyond 32 "
            "positions; 'in W'") in table
    plain, reach = runs["as trained"], runs["reach"]
    assert (plain["attn_window"], plain["attn_logn_base"]) == (None, None)
    assert (reach["attn_window"], reach["attn_logn_base"]) == (32, 32)
    assert reach["results"][0]["bpb"] == plain["results"][0]["bpb"]
    assert reach["results"][1]["buckets"][2]["bpb"] != plain["results"][1]["buckets"][2]["bpb"]
    # read in windows of 32 from an empty state, nothing reaches beyond the window or the base: the same scores
    assert reach["results"][1]["bpb_window"] == plain["results"][1]["bpb_window"]
