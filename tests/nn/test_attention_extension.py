"""Softmax attention beyond the training length: the sliding window and log-n query scaling against float64
attention written out here, through the layer, the model and document masking."""

import dataclasses
import math

import pytest
import torch

from k3lit.model import K3LM, ModelConfig
from k3lit.nn.attention import SoftmaxAttention, logn_scale, windowed_attention
from k3lit.nn.documents import Documents
from k3lit.testing import rel_rms

TINY = ModelConfig(vocab_size=50, dim=32, n_layers=4, layer_pattern="KA", n_heads=2, head_dim=16, mlp_hidden=48,
                   attnres_block_size=2, kda_backend="torch")


def attention_written_out(q, k, v, visible):  # noqa: ANN001, ANN201
    """softmax(q k^T / sqrt(d) where visible, else -inf) v, each query's keys by ``visible [T, S]``."""
    logits = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return logits.masked_fill(~visible, float("-inf")).softmax(-1) @ v


def band(queries: int, keys: int, window: int) -> torch.Tensor:
    """Query i (position keys - queries + i) sees key j when j <= its position and j > its position - window."""
    p = torch.arange(keys - queries, keys)[:, None]
    j = torch.arange(keys)[None, :]
    return (j <= p) & (j > p - window)


@pytest.mark.parametrize("T,cached,window", [(10, 0, 3), (10, 0, 1), (9, 0, 4), (8, 0, 8), (8, 0, 20), (5, 7, 3),
                                             (1, 12, 4), (6, 2, 5)])
def test_windowed_attention_equals_the_band_mask(seed, T, cached, window):
    q = torch.randn(2, 3, T, 8, dtype=torch.float64)
    k, v = (torch.randn(2, 3, cached + T, 8, dtype=torch.float64) for _ in range(2))
    want = attention_written_out(q, k, v, band(T, cached + T, window))
    assert rel_rms(windowed_attention(q, k, v, window), want) < 1e-13


def test_windowed_attention_refuses_what_it_cannot_mean():
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match="window >= 1"):
        windowed_attention(q, q, q, 0)
    with pytest.raises(ValueError, match="at least as many keys"):
        windowed_attention(q, q[:, :, :2], q[:, :, :2], 2)


def test_logn_scale_is_one_up_to_the_base_then_the_log_ratio():
    s = logn_scale(0, 12, 4)
    assert s.dtype == torch.float32 and s.shape == (12,)
    assert s[:4].tolist() == [1.0] * 4  # positions 0..3: at most 4 keys
    want = [math.log(p + 1) / math.log(4) for p in range(4, 12)]
    assert s[4:].tolist() == pytest.approx(want, rel=1e-7)
    assert logn_scale(5, 3, 4).tolist() == pytest.approx([math.log(n) / math.log(4) for n in (6, 7, 8)], rel=1e-7)
    with pytest.raises(ValueError, match="at least 2 positions"):
        logn_scale(0, 4, 1)


def layer(**kw) -> SoftmaxAttention:  # noqa: ANN003
    torch.manual_seed(0)
    attn = SoftmaxAttention(32, 2, 16, **kw).double()
    with torch.no_grad():  # QK-norm gains far from 1, so the logits are not near-uniform
        attn.q_norm.weight.normal_(2.0, 0.5)
        attn.k_norm.weight.normal_(2.0, 0.5)
    return attn


def layer_written_out(attn: SoftmaxAttention, x: torch.Tensor, visible: torch.Tensor, scale: torch.Tensor):  # noqa: ANN201
    B, T, _ = x.shape
    q, k, v = attn.qkv(x).view(B, T, 3, 2, 16).unbind(2)
    q, k, v = (t.transpose(1, 2) for t in (attn.q_norm(q), attn.k_norm(k), v))
    o = attention_written_out(q * scale[:, None], k, v, visible)
    return attn.o_proj(o.transpose(1, 2).reshape(B, T, -1))


def test_layer_with_window_and_logn_equals_attention_written_out(seed):
    x = torch.randn(2, 24, 32, dtype=torch.float64)
    attn = layer(window=5, logn_base=8)
    scale = torch.tensor([max(1.0, math.log(p + 1) / math.log(8)) for p in range(24)], dtype=torch.float64)
    want = layer_written_out(attn, x, band(24, 24, 5), scale)
    assert rel_rms(attn(x)[0], want) < 1e-6  # the scale in float32, as the layer applies it
    full = layer()(x)[0]
    assert rel_rms(full, want) > 1e-2  # the window and the scale change the layer


def test_window_and_base_at_least_the_length_change_no_bit(seed):
    x = torch.randn(2, 16, 32)
    want = layer()(x.double())[0]
    assert torch.equal(layer(window=16, logn_base=16)(x.double())[0], want)
    assert torch.equal(layer(window=100, logn_base=100)(x.double())[0], want)


def test_window_under_document_masking_is_both_masks(seed):
    ids = torch.randint(1, 50, (2, 20))
    ids[0, [5, 13]] = 0  # eos: three documents in row 0, one in row 1
    docs = Documents.from_tokens(ids, 0)
    x = torch.randn(2, 20, 32, dtype=torch.float64)
    attn = layer(window=4)
    got = attn(x, docs=docs)[0]
    for b in range(2):
        visible = docs.attention_mask()[b, 0] & band(20, 20, 4)
        want = layer_written_out(attn, x[b:b + 1], visible, torch.ones(20, dtype=torch.float64))
        assert rel_rms(got[b:b + 1], want) < 1e-13


def build(**kw) -> K3LM:  # noqa: ANN003
    torch.manual_seed(0)
    return K3LM(dataclasses.replace(TINY, **kw)).double().eval()


def test_window_and_logn_change_the_model_beyond_them(seed):
    """The model these fields make differs from the plain one on 30 tokens (decoding with them equals the full
    forward: tests/test_model.py::test_incremental_decoding_equals_full_forward)."""
    idx = torch.randint(0, 50, (2, 30))
    plain = build()(idx)[0]
    for kw in (dict(attn_window=6), dict(attn_logn_base=8)):
        assert rel_rms(build(**kw)(idx)[0], plain) > 1e-3


def test_an_attention_model_with_a_window_forgets_tokens_beyond_it(seed):
    """One softmax layer, plain residual: the logits at position p depend on tokens p - W + 1 .. p alone (each
    stacked layer would widen that by W - 1)."""
    model = build(layer_pattern="A", residual="plain", n_layers=1, attn_window=5)
    idx = torch.randint(0, 50, (1, 16))
    changed = idx.clone()
    changed[0, :4] = (idx[0, :4] + 1) % 50  # positions 0..3: outside the window of positions 8 and on
    a, b = model(idx)[0], model(changed)[0]
    assert torch.equal(a[:, 8:], b[:, 8:])
    assert not torch.allclose(a[:, 4:8], b[:, 4:8])  # position 4..7 still see some of them


@pytest.mark.parametrize("field,value", [("attn_window", 0), ("attn_logn_base", 1)])
def test_config_rejects_windows_and_bases_too_small(field, value):
    with pytest.raises(ValueError, match=f"ModelConfig.{field}={value}"):
        dataclasses.replace(TINY, **{field: value})


def test_decoding_under_a_window_keeps_a_cache_of_window_minus_one_positions(seed):
    attn = layer(window=4, logn_base=4)
    x = torch.randn(1, 12, 32, dtype=torch.float64)
    full = attn(x)[0]
    y, cache = attn(x[:, :10], return_state=True)
    assert (cache.k.shape[2], cache.start, cache.end) == (3, 7, 10)
    pieces = [y]
    for t in (10, 11):
        y, cache = attn(x[:, t:t + 1], cache)
        assert (cache.k.shape[2], cache.end) == (3, t + 1)
        pieces.append(y)
    assert rel_rms(torch.cat(pieces, 1), full) < 1e-6
    _, unbounded = layer()(x[:, :10], return_state=True)
    assert (unbounded.k.shape[2], unbounded.start) == (10, 0)


def test_window_and_logn_compile_as_one_graph(seed):
    """Training under a window shorter than the sequence (and the scale past its base): the query chunks and the
    masks trace into one graph that computes what the eager layer does."""
    torch._dynamo.reset()
    attn = layer(window=8, logn_base=8).float()
    x = torch.randn(2, 24, 32)
    compiled = torch.compile(attn, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x)[0], attn(x)[0], rtol=1e-5, atol=1e-6)


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the H200)")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("T,cached,window", [(4096, 0, 1024), (3000, 0, 2048), (1, 2047, 2048), (16, 4000, 512)])
def test_gpu_bf16_windowed_attention_follows_float64(seed, T, cached, window):
    """SDPA's bf16 kernels with the band masks, at lengths of several windows and in decoding, against the same
    attention in float64 on the same bf16 inputs."""
    q = torch.randn(1, 4, T, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 4, cached + T, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    want = attention_written_out(q.double(), k.double(), v.double(), band(T, cached + T, window).cuda())
    got = windowed_attention(q, k, v, window)
    assert got.dtype == torch.bfloat16 and rel_rms(got.double(), want) < 1e-2
