"""Document masking: a packed batch of documents gives each document the logits and gradients it gets alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3lit.model import K3LM, ModelConfig
from k3lit.nn.attention import SoftmaxAttention
from k3lit.nn.documents import Documents
from k3lit.nn.short_conv import ShortConvolution
from k3lit.testing import rel_rms

EOS = 0


def test_documents_of_a_packed_batch():
    idx = torch.tensor([[5, 6, EOS, 7, EOS, 8], [EOS, 9, 9, 9, 9, EOS]])
    d = Documents.from_tokens(idx, EOS)
    assert d.doc_id.tolist() == [[0, 0, 0, 1, 1, 2], [3, 4, 4, 4, 4, 4]]
    assert d.pos.tolist() == [[0, 1, 2, 0, 1, 0], [0, 0, 1, 2, 3, 4]]
    assert d.cu_seqlens.tolist() == [0, 3, 5, 6, 7, 12]
    mask = d.attention_mask()
    assert mask.shape == (2, 1, 6, 6)
    assert mask[0, 0, 4].tolist() == [False, False, False, True, True, False]  # its own document, no later token
    assert mask[1, 0, 1].tolist() == [False, True, False, False, False, False]


def test_masked_short_convolution_reads_no_earlier_document(seed):
    conv = ShortConvolution(6, width=4, backend="torch")
    x = torch.randn(1, 9, 6)
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    (y,), _ = conv(x, pos=pos)
    for lo, hi in ((0, 3), (3, 5), (5, 9)):
        (alone,), _ = conv(x[:, lo:hi])
        torch.testing.assert_close(y[:, lo:hi], alone, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="pass no state"):
        conv(x, torch.zeros(1, 6, 3), pos)


def test_docs_refuse_decoding_caches():
    layer = SoftmaxAttention(16, 2, 8)
    x = torch.randn(1, 4, 16)
    docs = Documents.from_tokens(torch.tensor([[1, EOS, 2, 3]]), EOS)
    with pytest.raises(ValueError, match="decoding takes no docs"):
        layer(x, None, True, docs)


def _model(backend: str, masking: bool) -> K3LM:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=50, dim=32, n_layers=4, layer_pattern="KA", n_heads=2, head_dim=16, mlp_hidden=48,
                      n_experts=4, top_k=2, expert_dim=16, n_shared_experts=1, first_dense_layers=1,
                      attnres_block_size=2, kda_backend=backend, document_masking=masking, eos_id=EOS)
    model = K3LM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("query", "gate_bias")):  # zero at init: give the AttnRes reads and gates a shape
                p.normal_()
    return model


def _doc(n: int, g: torch.Generator) -> torch.Tensor:
    return torch.cat([torch.randint(1, 50, (n - 1,), generator=g), torch.tensor([EOS])])


# "triton": the varlen KDA kernels (under TRITON_INTERPRET=1 on CPU); 45 tokens make two chunks of 32 in one document
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_packed_documents_match_each_document_alone(seed, backend):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = _model(backend, masking=True).to(dev)
    g = torch.Generator().manual_seed(1)
    docs = [_doc(n, g) for n in (5, 45, 1, 13)]
    row = torch.cat(docs)  # 64 tokens: four documents, each ending with eos
    packed = torch.stack([row, row.roll(-5)]).to(dev)  # the second row starts with the 45-token document
    logits, _ = model(packed)
    loss = F.cross_entropy(logits.flatten(0, 1), packed.roll(-1, 1).flatten(), reduction="sum")
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    # each document of each row on its own (row 2: its documents are row 1's, rotated by 5 tokens)
    total, lo = 0.0, 0
    for r in range(2):
        lo = 0
        for d in (docs if r == 0 else docs[1:] + docs[:1]):
            alone = packed[r : r + 1, lo : lo + len(d)]
            out, _ = model(alone)
            torch.testing.assert_close(out, logits[r : r + 1, lo : lo + len(d)], rtol=1e-5, atol=5e-6)
            target = packed[r].roll(-1)[lo : lo + len(d)]
            total = total + F.cross_entropy(out[0], target, reduction="sum")
            lo += len(d)
    total.backward()
    for name, p in model.named_parameters():
        if p.grad is not None:
            assert rel_rms(p.grad, grads[name]) < 2e-5, name


def test_without_masking_a_document_sees_the_one_before(seed):
    model = _model("torch", masking=False)
    g = torch.Generator().manual_seed(1)
    a, b = _doc(7, g), _doc(9, g)
    packed = torch.cat([a, b])[None]
    logits, _ = model(packed)
    alone, _ = model(b[None])
    assert (logits[0, 7:] - alone[0]).abs().max() > 1e-2


def test_masking_needs_an_eos_id():
    with pytest.raises(ValueError, match="eos_id"):
        K3LM(ModelConfig(vocab_size=50, dim=32, n_layers=1, n_heads=2, head_dim=16, document_masking=True))(
            torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"eos_id=50.*\[0, vocab_size=50\)"):
        ModelConfig(vocab_size=50, eos_id=50)


def test_masked_sublayers_compile_without_graph_breaks(seed):
    """Every sublayer compiles as one graph (``fullgraph=True``: a break raises) with the documents as an input,
    through the varlen KDA kernels' custom ops (under TRITON_INTERPRET=1 on CPU), and gives the eager logits; a
    batch with other document lengths reuses the graphs with a dynamic ``cu_seqlens`` length."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=50, dim=32, n_layers=2, layer_pattern="KA", n_heads=2, head_dim=16, mlp_hidden=48,
                      attnres_block_size=2, kda_backend="triton", document_masking=True, eos_id=EOS)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    eager = K3LM(cfg).to(dev)
    compiled = K3LM(cfg).to(dev)
    compiled.load_state_dict(eager.state_dict())
    compiled.compile_sublayers(fullgraph=True)
    g = torch.Generator().manual_seed(1)
    for lengths in ((5, 45, 1, 13), (20, 30, 14), (64,)):
        x = torch.stack([torch.cat([_doc(n, g) for n in lengths])] * 2).to(dev)
        torch.testing.assert_close(compiled(x)[0], eager(x)[0], rtol=1e-5, atol=5e-6)


@pytest.mark.parametrize("policy", ["block", "selective"])
def test_recomputation_sees_the_same_documents(seed, policy):
    """A checkpointed segment recomputes its sublayers with the documents of its forward: the same gradients."""
    g = torch.Generator().manual_seed(1)
    x = torch.stack([torch.cat([_doc(n, g) for n in (5, 45, 1, 13)])] * 2)
    grads = []
    for checkpointing in ("none", policy):
        model = _model("torch", masking=True)
        model.config.activation_checkpointing = checkpointing
        model(x)[0].logsumexp(-1).mean().backward()
        grads.append([p.grad for p in model.parameters() if p.grad is not None])
    assert len(grads[0]) == len(grads[1])
    for a, b in zip(*grads):
        assert rel_rms(b, a) < 1e-5
