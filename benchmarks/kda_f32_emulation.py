"""The float32 model test's KDA comparison replayed on the CPU, with the GPU's float32 arithmetic emulated.

The float32 model test (``tests/test_model.py::test_gpu_attnres_model_as_accurate_as_float32_pytorch``) compares
the model's gradients through the Triton kernels with the same float32 model in PyTorch, both against the float64
loop. Under ``TRITON_INTERPRET=1`` the kernels' products and exponentials are exact float32; on the GPU they are
3xTF32 tensor-core products (``input_precision="tf32x3"``) and ``ex2.approx`` exponentials. This script runs that
test's computation for one seed with the interpreter's arithmetic switched to an emulation of the GPU's:

- ``--dots tf32x3``: each ``tf32x3`` product as the GPU forms it: each operand rounded to TF32 (``cvt.rna``), its
  remainder rounded to TF32 again, and the three products big-big, big-small, small-big summed in float32 (the
  small-small one dropped); a plain ``tf32`` product truncates its float32 operands. ``--dots bf16x6``: the
  ``tf32x3`` products formed instead as Triton's ``bf16x6`` would (each operand split into three bf16 parts, the
  six products down to the mid-mid one summed in float32), float32-accurate products on tensor cores.
- ``--exp GPU``: ``exp(x)`` as ``2^(x log2 e)`` with the product rounded to float32 first, as Triton lowers
  ``tl.exp`` to ``ex2.approx.f32`` (the approximation's own error, under 2^-22, is not emulated). ``--exp ulp``:
  each exact exponential moved one float32 ulp up or down at random.

    python benchmarks/kda_f32_emulation.py --seed 1278776756 --block 3 [--dots tf32x3|bf16x6] [--exp GPU|ulp]

Prints the relative RMS error of all parameter gradients for the kernels and for PyTorch (one float32 CPU run), and
their ratio. ``--exp ulp`` is no less accurate than exact: how far it moves the error is how far one run can be
trusted as a measure on that seed, which is why the test's yardstick is the median of five float32 runs
(``benchmarks/f32_model_probe.py`` prints them on the GPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

if __name__ == "__main__":  # the kernels run under the interpreter, which must be chosen before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

TF32_MASK = np.uint32(0xFFFFE000)  # float32 bits that TF32 keeps (sign, exponent, 10 mantissa bits)


def tf32_round(x: np.ndarray) -> np.ndarray:
    """float32 rounded to the nearest TF32 value, ties away from zero (``cvt.rna.tf32.f32``)."""
    return ((x.astype(np.float32).view(np.uint32) + np.uint32(0x1000)) & TF32_MASK).view(np.float32)


def tf32_truncate(x: np.ndarray) -> np.ndarray:
    """float32 as the tensor cores read it for a one-pass TF32 product: the 13 low mantissa bits dropped."""
    return (x.astype(np.float32).view(np.uint32) & TF32_MASK).view(np.float32)


def bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 rounded to the nearest bfloat16 value (ties to even), as float32."""
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(torch.bfloat16).float().numpy()


def tf32x3_matmul(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``x @ y`` of float32 matrices as the GPU's 3xTF32: big and small TF32 parts, small-small dropped."""
    xb, yb = tf32_round(x), tf32_round(y)
    return np.matmul(tf32_round(x - xb), yb) + np.matmul(xb, tf32_round(y - yb)) + np.matmul(xb, yb)


def bf16x6_matmul(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``x @ y`` of float32 matrices as Triton's ``bf16x6``: three bf16 parts each, the six leading products."""
    x1, y1 = bf16_round(x), bf16_round(y)
    x2, y2 = bf16_round(x - x1), bf16_round(y - y1)
    x3, y3 = bf16_round(x - x1 - x2), bf16_round(y - y1 - y2)
    small = np.matmul(x3, y1) + np.matmul(x1, y3) + np.matmul(x2, y2)
    return small + np.matmul(x2, y1) + np.matmul(x1, y2) + np.matmul(x1, y1)


def tf32_matmul(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``x @ y`` of float32 matrices as one tensor-core TF32 pass (operands truncated)."""
    return np.matmul(tf32_truncate(x), tf32_truncate(y))


def emulate(dots: str, exp: str) -> None:
    """Patch the interpreter's products (``dots``: ``"exact"``, ``"tf32x3"``, ``"bf16x6"``) and exponentials
    (``exp``: ``"exact"``; ``"GPU"``; ``"ulp"``, each result moved one float32 ulp up or down at random: as
    accurate as exact, other roundings)."""
    builder = interpreter.InterpreterBuilder
    exact_dot = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if not (a.data.dtype == np.float32 and b.data.dtype == np.float32):
            return exact_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        split = "x3" in str(input_precision).lower()
        product = (bf16x6_matmul if dots == "bf16x6" else tf32x3_matmul) if split else tf32_matmul
        out = product(a.data, b.data)
        return interpreter.TensorHandle((out + d.data).astype(d.data.dtype), d.dtype.scalar)

    if dots != "exact":
        builder.create_dot = create_dot
    if exp == "GPU":
        log2e = np.float32(1.4426950408889634)
        builder.create_exp = lambda self, arg: self.unary_op(
            arg, lambda x: np.exp2((x * log2e).astype(x.dtype)).astype(x.dtype))
    elif exp == "ulp":
        rng = np.random.default_rng(0)

        def nudged(x):
            y = np.exp(x)
            up = rng.random(y.shape) < 0.5
            return np.where(up, np.nextafter(y, np.inf), np.nextafter(y, -np.inf)).astype(x.dtype)

        builder.create_exp = lambda self, arg: self.unary_op(arg, nudged)


def errors(seed: int, block: int) -> tuple[float, float]:
    """Relative RMS error of all parameter gradients against the float64 loop: (kernels, PyTorch), for the model
    and inputs that the float32 model test builds from ``seed`` (block-AttnRes with ``block`` sublayers), the
    kernels under the interpreter (``TRITON_INTERPRET=1`` set before triton was imported, as ``main`` runs)."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import test_model as tm

    from k3lit.model import K3LM
    from k3lit.testing import rel_rms

    torch.manual_seed(seed)
    cfg = dict(residual="block_attnres", attnres_block_size=block, n_layers=6, dim=96, n_experts=0)
    model = tm.build(**cfg)
    idx = torch.randint(0, tm.TINY.vocab_size, (2, 37))

    def loss(logits):
        return torch.nn.functional.cross_entropy(logits.double().flatten(0, 1), idx[:, 1:].flatten())

    def grads(backend: str) -> torch.Tensor:
        m = K3LM(dataclasses.replace(tm.TINY, kda_backend=backend, **cfg))
        m.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
        loss(m(idx[:, :-1])[0]).backward()
        return torch.cat([p.grad.double().flatten() for p in m.parameters()])

    loss(tm.literal_forward(model, idx[:, :-1])).backward()
    ref = torch.cat([p.grad.double().flatten() for p in model.parameters()])
    return rel_rms(grads("triton"), ref), rel_rms(grads("torch"), ref)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=1278776756)
    ap.add_argument("--block", type=int, default=3)
    ap.add_argument("--dots", choices=("exact", "tf32x3", "bf16x6"), default="exact",
                    help="the float32 products: exact, as the GPU's 3xTF32 (and TF32), or as bf16x6")
    ap.add_argument("--exp", choices=("exact", "GPU", "ulp"), default="exact",
                    help="tl.exp exact, as the GPU's ex2.approx of a rounded argument, or exact moved one ulp")
    args = ap.parse_args()
    emulate(args.dots, args.exp)
    ours, ref = errors(args.seed, args.block)
    print(f"seed {args.seed} block {args.block} dots {args.dots} exp "
          f"{args.exp}: kernels {ours:.3e}, PyTorch {ref:.3e}, ratio {ours / ref:.2f}")


if __name__ == "__main__":
    main()
