"""Held-out bits per byte by position: how well a model predicts a token according to how far into its sequence the
token is, at sequence lengths up to and beyond the one it trained on (length extrapolation).

A prepared held-out split is a packed token stream: its documents joined by the tokenizer's eos token
(:mod:`k3lit.data.prepare`). It is read as contiguous blocks of ``L + 1`` tokens in file order with litdata's
``TokensLoader``, as validation reads blocks of ``seq_len + 1``, so a block spans document boundaries, and KDA's
recurrent state and the softmax attention run across them within a block, as in training (a model trained with
``document_masking`` restarts both at every document, as it did in training; its buckets then count positions in
the block, not in the document). Each block is one
forward of its first ``L`` tokens (batch 1, no state carried from one block to the next); the target of position
``t`` (0-based) is token ``t + 1``. Positions fall into buckets ``[e_i, e_{i+1})`` with edges ``0, B, 2B, 4B, ...``
(:func:`bucket_edges`; ``B`` defaults to the training ``seq_len``), and each bucket's bits per byte, summed over
its positions in every block, is

    bpb = sum_t nats_t / ln 2 / sum_t bytes_t

with ``nats_t`` the cross-entropy of target ``t`` in nats and ``bytes_t`` the UTF-8 length of the text the target
token stands for (0 for eos; :meth:`~k3lit.data.tokenizer.Tokenizer.token_bytes`). Over all positions of one
length this is ``val/bpb`` of a validation pass over the same blocks.

Later buckets hold other text than earlier ones, so a bucket's bpb mixes how hard its text is with how far into the
sequence it lies. Each block is therefore also read in *windows* of ``W`` tokens (default: the training
``seq_len``): the block cut into consecutive pieces of ``W + 1`` tokens (the last may be shorter), each one forward
from an empty state, as a model trained at ``W`` reads text. Every target is then scored twice, with its whole
prefix in the block and with its window's prefix only, and a bucket's ``bpb_window`` is the same sum over the same
targets and bytes with the window's nats: ``bpb / bpb_window`` is what reading beyond ``W`` tokens of context does
to the model on identical bytes (below 1: the longer context helps; above 1: the model fails beyond its training
length).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers
import torch
import torch.nn.functional as F
from litdata import StreamingDataset
from litdata.streaming.item_loader import TokensLoader

from k3lit.data.prepare import PreparedCorpus
from k3lit.data.tokenizer import Tokenizer
from k3lit.model import K3LM

__all__ = ["bucket_edges", "bucket_sums", "bucket_label", "token_nats", "window_nats", "held_out_blocks",
           "check_same_tokenizer", "evaluate_length", "format_table", "plot_positions"]

HEAD_POSITIONS = 4096  # positions per LM-head call: [4096, vocab] float32 logits, not [L, vocab] at once


def bucket_edges(max_length: int, base: int) -> list[int]:
    """Edges ``[0, base, 2 base, 4 base, ..., E]`` of the position buckets, ``E`` the first edge ``>= max_length``:
    bucket ``i`` holds positions ``[edges[i], edges[i + 1])``.

    Raises:
        ValueError: ``max_length`` or ``base`` below 1.
    """
    if max_length < 1 or base < 1:
        raise ValueError(f"bucket edges need a length >= 1 and a bucket base >= 1 (got {max_length} and {base})")
    edges = [0, base]
    while edges[-1] < max_length:
        edges.append(2 * edges[-1])
    return edges


def bucket_label(start: int, end: int) -> str:
    """``"2k-4k"`` for ``[2048, 4096)``; plain numbers where an edge is no multiple of 1024."""
    def short(n: int) -> str:
        return f"{n // 1024}k" if n and n % 1024 == 0 else str(n)

    return f"{short(start)}-{short(end)}"


def bucket_sums(nats: torch.Tensor, target_bytes: torch.Tensor, edges: list[int]) -> torch.Tensor:
    """Per-bucket sums over the positions ``t = 0..L-1`` of one block: float64 ``[K, 3]`` of (targets, nats, bytes)
    for the ``K = len(edges) - 1`` buckets; a bucket past ``L`` sums to zeros.

    Args:
        nats: ``[L]`` cross-entropy of each position's target, in nats.
        target_bytes: ``[L]`` UTF-8 bytes of each position's target token.
        edges: increasing bucket edges starting at 0, the last one ``>= L`` (:func:`bucket_edges`).

    Raises:
        ValueError: the shapes differ, or the edges do not start at 0 and cover ``L``.
    """
    (length,) = nats.shape
    if target_bytes.shape != nats.shape:
        raise ValueError(f"nats {tuple(nats.shape)} and target_bytes {tuple(target_bytes.shape)} must both be [L]")
    if edges[0] != 0 or edges[-1] < length or any(a >= b for a, b in zip(edges, edges[1:])):
        raise ValueError(f"bucket edges {edges} must increase from 0 to at least the length {length}")
    k = len(edges) - 1
    where = torch.bucketize(torch.arange(length, device=nats.device),
                            torch.tensor(edges, device=nats.device), right=True) - 1
    return torch.stack([torch.bincount(where, weights=w.double(), minlength=k)
                        for w in (torch.ones_like(nats), nats, target_bytes)], dim=1)


def token_nats(model: K3LM, block: torch.Tensor, head_positions: int = HEAD_POSITIONS) -> torch.Tensor:
    """Cross-entropy (nats, float32 ``[L]``) of each target of one block, int64 ``[L + 1]``: one forward of
    ``block[:-1]``, the LM head applied ``head_positions`` positions at a time (in float32 for the loss, as
    :class:`~k3lit.train.module.K3LitModule` computes ``val/loss``). Call it in eval mode without gradients;
    an autocast context around it sets the precision of the forward."""
    x, y = block[None, :-1], block[1:]
    hidden = model.final_hidden(x)[0]  # [L, dim]
    out = torch.empty(y.shape, dtype=torch.float32, device=block.device)
    for s in range(0, y.numel(), head_positions):
        logits = model.lm_head(hidden[s:s + head_positions]).float()  # [<= head_positions, vocab]
        out[s:s + head_positions] = F.cross_entropy(logits, y[s:s + head_positions], reduction="none")
    return out


def held_out_blocks(prepared: PreparedCorpus, length: int, n_blocks: int) -> tuple[int, Iterator[torch.Tensor]]:
    """The first ``n_blocks`` blocks of ``length + 1`` tokens of the held-out split, in file order (those a
    validation pass with ``seq_len = length`` reads first): ``(count, iterator of int64 [length + 1])``, count =
    ``min(n_blocks, blocks the split holds)``.

    Raises:
        ValueError: the split holds no block of ``length + 1`` tokens; the message gives its size.
    """
    dataset = StreamingDataset(input_dir=str(prepared.split_dir("val")),
                               item_loader=TokensLoader(block_size=length + 1), shuffle=False)
    if len(dataset) == 0:
        raise ValueError(
            f"the held-out split ({prepared.meta['splits']['val']['n_tokens']:,} tokens in {prepared.root / 'val'}) "
            f"holds no block of {length + 1:,} tokens: drop length {length} from --lengths, or evaluate on a larger "
            "split (--data.val_fraction, --data.corpus)"
        )
    count = min(n_blocks, len(dataset))
    return count, (torch.from_numpy(np.asarray(dataset[i]).astype(np.int64)) for i in range(count))


def check_same_tokenizer(tokens_tokenizer: Tokenizer, checkpoint_state: dict | None) -> None:
    """Check that the held-out tokens were made with the tokenizer saved in the checkpoint
    (``checkpoint["K3DataModule"]``; None: nothing to compare with). Tokenizer JSON files are compared in the
    ``tokenizers`` library's own serialisation, so a re-saved copy (``k3lit export``'s) matches.

    Raises:
        ValueError: they differ; the message says how to evaluate with the checkpoint's tokenizer.
    """
    if checkpoint_state is None:
        return
    saved = checkpoint_state.get("tokenizer_json")
    path = getattr(tokens_tokenizer, "path", None)
    if saved is None or path is None:
        same = saved is None and path is None and tokens_tokenizer.spec == checkpoint_state.get("tokenizer_spec")
    else:
        same = tokenizers.Tokenizer.from_str(saved).to_str() == tokenizers.Tokenizer.from_file(str(path)).to_str()
    if not same:
        raise ValueError(
            f"the held-out tokens were made with tokenizer {tokens_tokenizer.spec!r}, not the checkpoint's "
            f"({checkpoint_state.get('tokenizer_spec')!r}; a 'bpe:N' tokenizer is trained per corpus): pass the "
            "checkpoint's tokenizer file as --data.tokenizer (k3lit export --ckpt CKPT --out DIR writes "
            "DIR/tokenizer.json), or leave --data.corpus and --data.val_fraction at the checkpoint's"
        )


def window_nats(model: K3LM, block: torch.Tensor, window: int) -> torch.Tensor:
    """Cross-entropy (nats, float32 ``[L]``) of each target of one block, int64 ``[L + 1]``, read in windows:
    ``block[s : s + window + 1]`` for ``s = 0, window, 2 window, ...``, each one forward from an empty state
    (:func:`token_nats`), so target ``t`` sees only the tokens of its window before it.

    Raises:
        ValueError: ``window`` below 1.
    """
    if window < 1:
        raise ValueError(f"window must be >= 1 token, got {window}")
    return torch.cat([token_nats(model, block[s:s + window + 1]) for s in range(0, block.numel() - 1, window)])


def evaluate_length(model: K3LM, blocks: Iterator[torch.Tensor], byte_table: torch.Tensor, edges: list[int],
                    autocast_dtype: torch.dtype | None = None, window: int | None = None) -> dict[str, Any]:
    """Bits per byte by position bucket over ``blocks`` (int64 ``[L + 1]`` each, all of one length ``L``).

    Args:
        model: in eval mode, on the device the blocks are moved to.
        blocks: token blocks (see :func:`held_out_blocks`).
        byte_table: int64 ``[vocab]`` UTF-8 bytes per token id (:meth:`Tokenizer.token_bytes`), on the model's device.
        edges: bucket edges (:func:`bucket_edges`), the last one ``>= L``.
        autocast_dtype: the forward under ``torch.autocast`` in this dtype (e.g. ``torch.bfloat16``); None: the
            weights' dtype.
        window: also score every target with its ``window``-token window's prefix only (:func:`window_nats`;
            the module docstring); None: not.

    Returns:
        ``{"length": L, "blocks": n, "loss": nats per target, "bpb": over all positions, "window": W or None,
        "bpb_window": over all positions read in windows, "buckets": [{"start", "end", "targets", "bytes", "bpb",
        "bpb_window"}, ...]}``; a bucket with no byte (past ``L``, or eos targets only) has ``bpb`` None, and the
        ``bpb_window`` entries are None without a ``window``. Units: bits per UTF-8 byte; ``loss`` in nats per
        token, as ``val/loss``.

    Raises:
        ValueError: no block, blocks of different lengths, or a ``window`` below 1.
    """
    device = byte_table.device
    sums, length, n = None, None, 0
    for block in blocks:
        block = block.to(device)
        if length is None:
            length = block.numel() - 1
        elif block.numel() - 1 != length:
            raise ValueError(f"blocks of {length + 1} and {block.numel()} tokens: evaluate one length at a time")
        with torch.inference_mode(), torch.autocast(device.type, dtype=autocast_dtype,
                                                    enabled=autocast_dtype is not None):
            nats = token_nats(model, block)
            if window is None or window >= length:  # one window holds the whole block: the same nats
                windowed = None if window is None else nats
            else:
                windowed = window_nats(model, block, window)
        part = bucket_sums(nats, byte_table[block[1:]], edges)
        if windowed is not None:  # a fourth column: the same targets' nats, read in windows
            part = torch.cat([part, bucket_sums(windowed, byte_table[block[1:]], edges)[:, 1:2]], dim=1)
        sums = part if sums is None else sums + part
        n += 1
    if sums is None:
        raise ValueError("evaluate_length needs at least one block")
    columns = sums.cpu().T.tolist()
    targets, nats, nbytes = columns[:3]
    in_windows = columns[3] if window is not None else [None] * len(targets)

    def bpb(v: float | None, nb: float) -> float | None:
        return v / math.log(2) / nb if nb and v is not None else None

    buckets = [{"start": a, "end": b, "targets": int(t), "bytes": int(nb), "bpb": bpb(v, nb), "bpb_window": bpb(w, nb)}
               for a, b, t, v, nb, w in zip(edges, edges[1:], targets, nats, nbytes, in_windows)]
    total_bytes = sum(nbytes)
    return {"length": length, "blocks": n, "loss": sum(nats) / sum(targets), "bpb": bpb(sum(nats), total_bytes),
            "window": window, "bpb_window": None if window is None else bpb(sum(in_windows), total_bytes),
            "buckets": buckets}


def format_table(results: list[dict[str, Any]]) -> str:
    """Rows: evaluation lengths, each followed (where it was read in windows shorter than itself) by the same
    bytes read in windows (``in W``); columns: blocks, bits per byte of each position bucket, and of all positions
    (``-`` where a bucket holds no byte)."""
    edges = max((r["buckets"] for r in results), key=len)
    head = ["length", "blocks", *(bucket_label(b["start"], b["end"]) for b in edges), "all"]
    rows = [head]

    def num(v: float | None) -> str:
        return "-" if v is None else f"{v:.4f}"

    for r in results:
        pad = ["-"] * (len(edges) - len(r["buckets"]))
        rows.append([f"{r['length']:,}", str(r["blocks"]), *(num(b["bpb"]) for b in r["buckets"]), *pad,
                     num(r["bpb"])])
        if r.get("window") and r["window"] < r["length"]:
            rows.append([f"in {r['window']:,}", "", *(num(b.get("bpb_window")) for b in r["buckets"]), *pad,
                         num(r.get("bpb_window"))])
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows)


def plot_positions(results: list[dict[str, Any]], title: str, path: Path) -> None:
    """Bits per byte against position bucket, one line per evaluation length, drawn into ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    edges = max((r["buckets"] for r in results), key=len)
    fig, ax = plt.subplots(figsize=(2 + 0.9 * len(edges), 4), dpi=100)
    for r in results:
        points = [(i, b["bpb"]) for i, b in enumerate(r["buckets"]) if b["bpb"] is not None]
        line, = ax.plot(*zip(*points), marker="o", label=f"length {r['length']:,} ({r['blocks']} blocks)")
        if r.get("window") and r["window"] < r["length"]:  # the same bytes read in windows, dashed
            points = [(i, b["bpb_window"]) for i, b in enumerate(r["buckets"]) if b.get("bpb_window") is not None]
            ax.plot(*zip(*points), marker="x", linestyle="--", color=line.get_color(),
                    label=f"the same bytes in {r['window']:,}-token windows")
    ax.set_xticks(range(len(edges)), [bucket_label(b["start"], b["end"]) for b in edges])
    ax.set_xlabel("position in the sequence (tokens)")
    ax.set_ylabel("held-out bits per byte")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
