import json

import pytest

from k3lit.data.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    load_tokenizer,
    parse_tokenizer_spec,
    spec_eos_id,
    spec_vocab_size,
    train_bpe,
)

SAMPLES = ["def f(x):\n    return x + 1\n", "héllo wörld ✓ 你好", "", "  tabs\tand\nnewlines\r\n"]


def _train_texts():
    return [f"def func_{i}(a, b):\n    return a * {i} + b  # naïve\n" for i in range(200)] + SAMPLES


def test_byte_round_trip_and_ids():
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.eos_id) == (257, 256)
    for s in SAMPLES:
        ids = tok.encode(s)
        assert all(0 <= i < 256 for i in ids) and len(ids) == len(s.encode())
        assert tok.decode(ids + [tok.eos_id]) == s
    assert tok.fingerprint() == ByteTokenizer().fingerprint()


def test_train_bpe_round_trip_and_reload(tmp_path):
    path = tmp_path / "bpe.json"
    tok = train_bpe(_train_texts(), 320, path)
    assert path.is_file() and tok.vocab_size <= 320 and tok.eos_id == 0
    for s in SAMPLES:
        ids = tok.encode(s)
        assert tok.eos_id not in ids
        assert tok.decode(ids + [tok.eos_id]) == s
    assert len(tok.encode("def func_7(a, b):")) < len("def func_7(a, b):")  # merges happened
    again = HFTokenizer(path)
    assert again.fingerprint() == tok.fingerprint() and again.encode(SAMPLES[1]) == tok.encode(SAMPLES[1])
    assert spec_vocab_size(str(path)) == tok.vocab_size


def test_load_tokenizer_specs(tmp_path):
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)
    path = tmp_path / "tok.json"
    trained = load_tokenizer("bpe:300", bpe_path=path, train_texts=_train_texts())
    assert trained.spec == "bpe:300" and path.is_file()
    cached = load_tokenizer("bpe:300", bpe_path=path)  # no texts needed once trained
    assert cached.fingerprint() == trained.fingerprint()
    assert load_tokenizer(str(path)).encode("def x") == trained.encode("def x")
    assert spec_vocab_size("byte") == 257 and spec_vocab_size("bpe:4096") == 4096
    # the end-of-document id, known before training, is the one the trained tokenizer has
    assert spec_eos_id("bpe:300") == trained.eos_id and spec_eos_id(str(path)) == trained.eos_id
    assert spec_eos_id("byte") == ByteTokenizer().eos_id


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("wordpiece", "Unknown tokenizer spec"),
        ("bpe:abc", "must be an integer"),
        ("bpe:100", ">= 257"),
        ("", "non-empty"),
    ],
)
def test_bad_specs(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_tokenizer_spec(spec)


def test_bpe_needs_training_data():
    with pytest.raises(ValueError, match="k3lit prepare"):
        load_tokenizer("bpe:300")


def test_hf_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        HFTokenizer(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not a Hugging Face"):
        HFTokenizer(bad)
    path = tmp_path / "bpe.json"
    train_bpe(_train_texts(), 300, path)
    cfg = json.loads(path.read_text())
    cfg["added_tokens"] = []
    cfg["model"]["vocab"].pop("<|endoftext|>")
    noeos = tmp_path / "noeos.json"
    noeos.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="no end-of-document token"):
        HFTokenizer(noeos)


def test_token_bytes_sum_to_the_utf8_length_of_the_text(tmp_path):
    """Summed over a text's ids, the byte table gives its UTF-8 length, also where BPE pieces split a character;
    the end-of-document token stands for no byte."""
    texts = SAMPLES + ["ünïcödé ✓✓ 你好你好 — naïve\n" * 3]
    for tok in (ByteTokenizer(), train_bpe(_train_texts(), 320, tmp_path / "bpe.json")):
        table = tok.token_bytes()
        assert table.shape == (tok.vocab_size,) and table[tok.eos_id] == 0
        for s in texts:
            assert table[tok.encode(s) + [tok.eos_id]].sum() == len(s.encode("utf-8")), (tok, s)
