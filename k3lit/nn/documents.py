"""Document boundaries inside packed training sequences (document masking).

The corpus joins documents with the tokenizer's end-of-document (eos) token and cuts the stream into sequences of
``seq_len + 1`` tokens, so a sequence holds the tail of one document, whole documents and the head of another.
With document masking a token sees only earlier tokens of its own document: softmax attention masks the others,
KDA restarts its state (a packed batch of variable-length sequences, ``cu_seqlens``) and the short convolution
reads no token of an earlier document.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Documents:
    """Where the documents of a ``[B, T]`` batch begin: at each row's first token and after every eos token (the
    eos ends the document it follows).

    Attributes:
        doc_id: int64 ``[B, T]``: each token's document, numbered over the flattened batch (row after row).
        pos: int64 ``[B, T]``: each token's position in its document, 0 at a document's first token.
        cu_seqlens: int64 ``[N + 1]``: the N documents' cumulative lengths over the ``B * T`` flattened tokens,
            KDA's packed layout (:func:`k3lit.ops.kda.kda`); a document cut by a row's end counts once per row.
    """

    doc_id: torch.Tensor
    pos: torch.Tensor
    cu_seqlens: torch.Tensor

    @classmethod
    def from_tokens(cls, idx: torch.Tensor, eos_id: int) -> Documents:
        """The documents of the int64 token batch ``idx [B, T]`` whose documents end with ``eos_id``. Reads the
        number of documents back to the host (one synchronisation; KDA's varlen launch needs it anyway)."""
        B, T = idx.shape
        start = torch.ones_like(idx, dtype=torch.bool)
        start[:, 1:] = idx[:, :-1] == eos_id
        flat = start.flatten()
        t = torch.arange(B * T, device=idx.device)
        first = torch.where(flat, t, 0).cummax(0).values  # index of each token's document start
        starts = flat.nonzero().flatten()
        cu = torch.cat([starts, starts.new_full((1,), B * T)])
        return cls(doc_id=(flat.cumsum(0) - 1).view(B, T), pos=(t - first).view(B, T), cu_seqlens=cu)

    def attention_mask(self) -> torch.Tensor:
        """bool ``[B, 1, T, T]``: query i may attend to key j (j <= i, same document), for
        ``F.scaled_dot_product_attention``'s ``attn_mask``."""
        T = self.doc_id.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool, device=self.doc_id.device).tril()
        return ((self.doc_id[:, :, None] == self.doc_id[:, None, :]) & causal)[:, None]
