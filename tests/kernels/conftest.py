import os

import torch

# The Triton kernels run under the interpreter on machines without CUDA. Triton reads the flag when a kernel
# is decorated, so it must be set before k3lit.kernels is first imported (test modules import it lazily).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
