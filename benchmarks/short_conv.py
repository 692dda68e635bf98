"""The short convolution (causal depthwise conv + SiLU over KDA's fused q, k, v) on one GPU: k3lit's Triton kernels
against fla's ``causal_conv1d`` (its Triton backend), and which launch settings suit each of k3lit's kernels.

    python benchmarks/short_conv.py [--json F]                # correctness, then times; RESULTS.md section
    python benchmarks/short_conv.py --sweep [--json F]        # also every tiling of each k3lit kernel (first shape)
    python benchmarks/short_conv.py --from_json F             # the section from a stored run

Correctness first, per shape: relative RMS error of y, dx and dw against the float64 convolution on the same bf16
inputs, for k3lit and fla. ``--sweep`` times each of k3lit's kernels (``_fwd``, ``_bwd_p``, ``_bwd_dx``: the
launchers with ``k3lit.kernels.short_conv.conv.TUNING`` set) at every (time steps, channels, warps) of a grid, and
checks that every tiling's y and dx equal the default's to the bit (per-element sums in a fixed order); dw's
per-program partial sums follow the tiling.

Times: ``triton.testing.do_bench`` medians in one process. Bandwidth: the least bytes a pass must move
(forward: read x, write y; forward + backward: also read x and dy, write dx) over its time; the H200 moves
4.8 TB/s at most.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.results import (  # noqa: E402
    add_output_arguments,
    add_shapes_argument,
    command,
    environment,
    gpu_run_or_load,
    versions,
)
from k3lit.kernels.short_conv import conv, short_conv_silu_triton  # noqa: E402
from k3lit.testing import rel_rms  # noqa: E402

SHAPES = ((16, 2048, 2304), (4, 8192, 2304), (1, 32768, 2304), (4, 2048, 6144))
"""(B, T, C): ``small``'s batch at 2,048 and 8,192 tokens and ``small_32k``'s (C = 3 x 768), ``medium``'s width."""
WIDTH = 4
SWEEP = {"bt": (32, 64, 128), "bc": (32, 64, 128), "warps": (2, 4, 8)}


def reference(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Float64 ``silu(causal conv1d)`` over a zero history and its gradients: ``(y, dx, dw)``."""
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    C, W = w.shape
    y = F.silu(F.conv1d(F.pad(x64.transpose(1, 2), (W - 1, 0)), w64[:, None], groups=C)).transpose(1, 2)
    return (y.detach(), *torch.autograd.grad(y, (x64, w64), dy.double()))


def fla_conv():
    """fla's ``causal_conv1d(x, weight, activation="silu")`` (Triton backend) as ``f(x, w) -> y``, or None."""
    try:
        from fla.modules.causal_conv1d import causal_conv1d
    except ImportError:
        return None
    return lambda x, w: (causal_conv1d(x, weight=w, activation="silu", backend="triton")[0],)


def passes(f, x: torch.Tensor, w: torch.Tensor, dys: tuple[torch.Tensor, ...]):  # noqa: ANN001, ANN201
    """``(forward, forward + backward, outputs)`` of ``f(x, w) -> ys`` (channel groups of y, ``dys`` their
    gradients): two timeable closures and ``(y, dx, dw)``."""
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()

    def fwd() -> tuple[torch.Tensor, ...]:
        return f(x, w)

    def fwd_bwd() -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad(f(xg, wg), (xg, wg), dys)

    ys = f(xg, wg)
    return fwd, fwd_bwd, (torch.cat([y.detach() for y in ys], -1), *torch.autograd.grad(ys, (xg, wg), dys))


def kernel_times(x: torch.Tensor, w: torch.Tensor, dy: list[torch.Tensor], bench) -> list[dict]:  # noqa: ANN001
    """Each k3lit kernel alone at every tiling of :data:`SWEEP` (the other kernels at their defaults; the output in
    KDA's three parts, ``dy`` their gradients), with whether its y and dx equal the default tiling's to the bit."""
    default = dict(conv.TUNING)
    y0, (dx0, _) = conv.conv_fwd(x, w, 3), conv.conv_bwd(x, w, dy)
    rows = []
    for kernel in tuple(conv.TUNING):  # each kernel of conv_fwd and conv_bwd (TUNING sets them all)
        for bt, bc, warps in itertools.product(*SWEEP.values()):
            conv.TUNING[kernel] = (bt, bc, warps)
            try:
                same = (all(map(torch.equal, conv.conv_fwd(x, w, 3), y0))
                        and torch.equal(conv.conv_bwd(x, w, dy)[0], dx0))
                # the backward launcher whole (both kernels, the dw reduction): the tilings of one kernel differ
                ms = bench((lambda: conv.conv_fwd(x, w, 3)) if kernel == "fwd" else (lambda: conv.conv_bwd(x, w, dy)))
            except Exception as e:  # a tiling that does not compile (shared memory, registers)
                rows.append({"kernel": kernel, "bt": bt, "bc": bc, "warps": warps, "ms": None, "error": str(e)[:80]})
                continue
            finally:
                conv.TUNING.update(default)
            rows.append({"kernel": kernel, "bt": bt, "bc": bc, "warps": warps, "ms": ms, "same": same})
    return rows


def gpu_bench(fn) -> float:  # noqa: ANN001
    """Median milliseconds of ``fn`` by ``triton.testing.do_bench``."""
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=200)


def measure(a: argparse.Namespace, device: str = "cuda", bench=gpu_bench) -> dict:  # noqa: ANN001
    """Errors and times of every shape of ``a.shapes`` (and the tilings with ``a.sweep``) on ``device``, timed by
    ``bench(fn) -> ms`` (the tests run it on the CPU, with the kernels under ``TRITON_INTERPRET=1``)."""
    fla = fla_conv() if device == "cuda" else None
    out = {"env": versions(), "command": command(), "width": WIDTH, "shapes": [], "sweep": []}
    for B, T, C in a.shapes:
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(B, T, C, device=device, generator=g).bfloat16()
        w = (torch.randn(C, WIDTH, device=device, generator=g) / WIDTH**0.5).bfloat16()
        dy = torch.randn(B, T, C, device=device, generator=g).bfloat16()
        want = reference(x, w, dy)
        row = {"B": B, "T": T, "C": C, "bytes_fwd": 2 * x.numel() * 2, "bytes_fwd_bwd": 5 * x.numel() * 2}
        dys = [t.contiguous() for t in dy.chunk(3, -1)]  # KDA's q, k and v gradients, apart
        for name, f, grads in (("k3lit", lambda x, w: short_conv_silu_triton(x, w, 3), dys), ("fla", fla, (dy,))):
            if f is None:
                continue
            try:
                fwd, fwd_bwd, got = passes(f, x, w, tuple(grads))
            except Exception as e:  # the peer's failure is reported, not ours to fix
                if name == "k3lit":
                    raise
                row[name] = {"error": f"{type(e).__name__}: {str(e)[:100]}"}
                continue
            row[name] = {"err": {k: rel_rms(g_, w_) for k, g_, w_ in zip(("y", "dx", "dw"), got, want, strict=True)},
                         "fwd_ms": bench(fwd), "fwd_bwd_ms": bench(fwd_bwd)}
        out["shapes"].append(row)
        if a.sweep and not out["sweep"]:  # the tilings at the first shape (each compiles once: minutes)
            out["sweep"].append({"B": B, "T": T, "C": C, "rows": kernel_times(x, w, dys, bench)})
        print(row, flush=True)
    return out


def table(r: dict) -> str:
    lines = [
        f"Written by `benchmarks/short_conv.py`. {environment(r['env'])}. Command: {r['command']}. bf16 x and "
        f"dy, kernel width {r['width']}; k3lit: `short_conv_silu_triton(parts=3)` (y and dy as three channel groups, "
        "as a KDA layer's q, k and v); fla: `causal_conv1d(activation=\"silu\", "
        "backend=\"triton\")`. Error: relative RMS against the float64 convolution of the same inputs. TB/s: the "
        "least bytes the pass must move (forward 2, forward+backward 5 tensors of B x T x C) over its median time.",
        "",
        "| B x T x C | impl | y / dx / dw error | fwd ms | fwd TB/s | fwd+bwd ms | fwd+bwd TB/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in r["shapes"]:
        for name in ("k3lit", "fla"):
            if name not in s:
                continue
            if "error" in s[name]:
                lines.append(f"| {s['B']} x {s['T']:,} x {s['C']:,} | {name} | failed: {s[name]['error']} | | | | |")
                continue
            m, e = s[name], s[name]["err"]
            lines.append(f"| {s['B']} x {s['T']:,} x {s['C']:,} | {name} | {e['y']:.1e} / {e['dx']:.1e} / "
                         f"{e['dw']:.1e} | {m['fwd_ms']:.3f} | {s['bytes_fwd'] / m['fwd_ms'] / 1e9:.2f} | "
                         f"{m['fwd_bwd_ms']:.3f} | {s['bytes_fwd_bwd'] / m['fwd_bwd_ms'] / 1e9:.2f} |")
    for sw in r["sweep"]:
        lines += ["", f"Tilings at {sw['B']} x {sw['T']:,} x {sw['C']:,} (fastest three per kernel; `_bwd_p` and "
                      "`_bwd_dx` timed as the whole backward launcher; default "
                      f"{', '.join(f'{k} {v}' for k, v in conv.TUNING.items())}):", "",
                  "| kernel | time steps x channels, warps | ms | y and dx as the default's |", "|---|---|---|---|"]
        for kernel in conv.TUNING:
            done = sorted((x for x in sw["rows"] if x["kernel"] == kernel and x["ms"] is not None),
                          key=lambda x: x["ms"])
            for x in done[:3]:
                lines.append(f"| `_{kernel}` | {x['bt']} x {x['bc']}, {x['warps']} | {x['ms']:.3f} | "
                             f"{'same bits' if x['same'] else 'DIFFERENT'} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shapes_argument(p, SHAPES, "B x T x C")
    p.add_argument("--sweep", action="store_true", help="also time every tiling of each k3lit kernel")
    add_output_arguments(p, "raw results")
    gpu_run_or_load(p.parse_args(), measure, "Short convolution", table)


if __name__ == "__main__":
    main()
