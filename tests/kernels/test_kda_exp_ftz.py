"""``chunk_fwd._exp_rebased`` in ``_prep_fwd``'s sm_90a PTX (CPU only: the compiler needs no GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_rebased_exponentials_differ_from_tl_exp_only_in_ftz(tmp_path):
    """``chunk_fwd._exp_rebased``: ``_prep_fwd``'s sm_90a PTX (bf16, no backward) holds the same instructions (registers
    renumbered; as a multiset: LLVM orders the inline-PTX exponentials apart from their multiplies) as the same
    kernel with ``tl.exp`` in its place, except that the rebased exponentials (|x| <= 87: normal results) are
    ``ex2.approx.ftz.f32``: all of them, since the W pass reads the K⊙exp(G) formed from rebased factors (no
    exp(G) of its own, down to e^-160 at C = 32, which would need ``tl.exp``'s subnormals). Float32 inputs take
    ``tl.exp`` throughout. Prints the count of flushed exponentials."""
    code = """
import collections, importlib.util, json, re, sys
sys.path.insert(0, ".")
from pathlib import Path
import torch
from benchmarks.kernel_resources import _kda
from k3lit.kernels import aot
from k3lit.kernels.kda import chunk_fwd as chunk

def ptx(dtype):
    launch = _kda(1, 4096, 16, 128, 128, False, False, dtype, only=("_prep_fwd",), save=False)[0]
    text = aot.compile_kernel(launch).asm["ptx"]
    body = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith(
        (".b8", ".b16", ".b32", ".b64", ".loc", ".file", "//", "$L__", ".section", "{", "}"))]
    return [" ".join(re.sub(r"%[a-z]+\\d+", "%x", line).split()) for line in body]

ftz = ptx(torch.bfloat16)
f32 = ptx(torch.float32)
src = Path(chunk.__file__).read_text()
old = "    if F32:\\n        return tl.exp(x)"
assert src.count(old) == 1
path = Path(sys.argv[1]) / "chunk_tl_exp.py"  # _exp_rebased always tl.exp; Triton reads kernels from files
path.write_text(src.replace(old, "    if True:\\n        return tl.exp(x)"))
spec = importlib.util.spec_from_file_location("k3lit.kernels.kda.chunk_fwd", path)
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
sys.modules["k3lit.kernels.kda.chunk_fwd"] = mod
import k3lit.kernels.kda as package
package.chunk_fwd = mod
plain = ptx(torch.bfloat16)
print(json.dumps(dict(ftz=sum("ex2.approx.ftz.f32" in l for l in ftz), plain=sum("ex2.approx.f32" in l for l in ftz),
                      f32_ftz=sum("ftz" in l for l in f32 if "ex2" in l),
                      same=collections.Counter(l.replace("ex2.approx.ftz.f32", "ex2.approx.f32") for l in ftz)
                      == collections.Counter(plain))))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    print(out)
    assert out["same"] and out["ftz"] > 0 and out["plain"] == 0 and out["f32_ftz"] == 0, out
