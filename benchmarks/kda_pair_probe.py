"""Where the time of session 12's pair prep went: ``_prep_pair_fwd`` of commit ec323e6 (the forward without
gradients in pairs of chunks, removed after it) against ``_prep_fwd``, with parts of it switched off.

    python benchmarks/kda_pair_probe.py        # on a GPU, from a git checkout (reads ec323e6's chunk.py)
    python benchmarks/kda_pair_probe.py --sass # CPU: static sm_90a instruction counts of the two kernels

Each variant is ec323e6's ``kernels/kda/chunk.py`` with one text substitution, imported as its own module and timed
kernel by kernel (CUPTI, ``kda_breakdown.kernel_ms``) on the forward without gradients, bf16, K = V = D. Variants:
one chunk a step (``fwd_pairs="off"``: ``_prep_fwd``); the pair kernel as committed (the two chunks unrolled by
``tl.static_range``); without its merge (wrong results, for the timing only); with a runtime loop over the two
chunks instead of the unrolled one; the merge's X products in bf16 instead of TF32; the merge without forming X.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.kda import inputs  # noqa: E402
from benchmarks.kda_breakdown import kernel_ms  # noqa: E402

COMMIT = "ec323e6"
MERGE = "        _merge_pair(Gc, Kd, Qg, W, U, Mi, i_h, t0, n_pair - C, rows, H, K, V, C, BK, BV, F32)\n"
UNROLLED = """    for half in tl.static_range(2):
        t1 = t0 + half * C
        n_valid = n_a if half == 0 else n_pair - C
"""
RUNTIME = """    for half in range(0, 2):
        t1 = t0 + half * C
        n_valid = tl.where(half == 0, n_a, n_pair - C)
"""
X_PRODUCT = ("        X += _dot(_op(tl.load(W + offb, mask=m_b[:, None] & m_c, other=0.0), F32), "
             "tl.trans(_op(b_kd, F32)), F32)\n")


def variants(src: str) -> dict[str, tuple[str, str]]:
    """``{name: (chunk.py source, TUNING["fwd_pairs"])}``."""
    for text in (MERGE, UNROLLED, X_PRODUCT):
        assert text in src, f"not in {COMMIT}'s chunk.py: {text!r}"
    bf16 = (src.replace("_dot_aq(Xt, b_wa, F32)", "_dot(_op(X, F32), _op(b_wa, F32), F32)")
            .replace("_dot_aq(Xt, b_ua, F32)", "_dot(_op(X, F32), _op(b_ua, F32), F32)"))
    return {"one chunk a step (_prep_fwd)": (src, "off"), "pair": (src, "auto"),
            "pair without the merge": (src.replace(MERGE, "        pass\n"), "auto"),
            "pair, runtime loop over the chunks": (src.replace(UNROLLED, RUNTIME), "auto"),
            "pair, merge products in bf16": (bf16, "auto"),
            "pair, merge without X": (src.replace(X_PRODUCT, ""), "auto")}


def load(text: str, path: Path):
    """``text`` (a chunk.py) imported as a module from ``path`` (Triton reads a kernel's source from its file)."""
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def static_instructions(mod, name: str, mode: str) -> int:
    """Static sm_90a instruction count of kernel ``name`` of ``mod`` as the forward without gradients launches it at
    B1 T16384 H16 D128 bf16 (compiled offline; the launches are recorded on ``meta`` tensors, not run)."""
    from benchmarks.kda_sass import disassemble
    from k3lit.kernels import aot

    mod.TUNING["fwd_pairs"] = mode
    kernels = [n for n in ("_prep_fwd", "_prep_pair_fwd", "_scan_fwd", "_scan_fwd_t", "_out_fwd") if hasattr(mod, n)]
    x = torch.empty(1, 16384, 16, 128, device="meta", dtype=torch.bfloat16)
    with aot.record_launches(mod, *kernels) as launches:
        mod.chunk_fwd(x, x, x, torch.empty(x.shape, device="meta"), x[..., 0], 128**-0.5, None, False, None, 32,
                      save=False)
    launch = next(x for x in launches if x.name == name)
    return len(disassemble(aot.compile_kernel(launch).asm["cubin"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sass", action="store_true", help="print static instruction counts (CPU) instead of timing")
    args = ap.parse_args()
    src = subprocess.run(["git", "show", f"{COMMIT}:kernels/kda/chunk.py"], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parents[1]).stdout
    tmp = Path(tempfile.mkdtemp())
    if args.sass:
        if os.environ.get("TRITON_INTERPRET") == "1":
            sys.exit("unset TRITON_INTERPRET: the kernels must be compilable JIT functions")
        for i, (name, (text, mode)) in enumerate(variants(src).items()):
            kernel = "_prep_fwd" if mode == "off" else "_prep_pair_fwd"
            count = static_instructions(load(text, tmp / f"kda_pair_variant_{i}.py"), kernel, mode)
            print(f"{name:36s} {kernel} {count} static instructions", flush=True)
        return
    for B, T, H, D in ((1, 16384, 16, 128), (8, 2048, 32, 256)):
        xs = inputs(B, T, H, D, D)
        for i, (name, (text, mode)) in enumerate(variants(src).items()):
            mod = load(text, tmp / f"kda_pair_variant_{i}.py")
            mod.TUNING["fwd_pairs"] = mode
            with torch.no_grad():
                ks = kernel_ms(lambda mod=mod, xs=xs, D=D: mod.chunk_fwd(*xs, D**-0.5, None, False, None, 32,
                                                                           save=False), n=10)
            print(f"B{B} T{T} H{H} D{D} {name:36s}", " ".join(f"{k} {v:.3f}" for k, v in ks.items() if k[0] == "_"),
                  flush=True)


if __name__ == "__main__":
    main()
