"""Triton kernels for Kimi Delta Attention, importable as ``k3lit.kernels.kda``.

Public functions:

* :func:`kda_triton` — chunked forward and backward (training and prefill), differentiable, registered as
  the torch custom ops ``k3lit::kda_chunk_fwd`` / ``k3lit::kda_chunk_bwd`` so ``torch.compile`` keeps them
  in one graph.
* :func:`kda_decode_triton` — one decoding step (T = 1) with the state updated in place.
* :func:`kda_recurrent_triton` — token-by-token forward for any T (no gradient), e.g. short prompts.

Math, chunk size, the numeric argument for rebasing and the files of this package: ``README.md`` in this folder.
"""

from k3lit.kernels.kda.fused_recurrent import kda_decode_triton, kda_recurrent_triton
from k3lit.kernels.kda.op import kda_triton

__all__ = ["kda_triton", "kda_decode_triton", "kda_recurrent_triton"]
