"""KDA launch settings: the op as a KDA layer calls it, timed under alternative ``plan.TUNING`` settings.

    python benchmarks/kda_tuning.py [--json F]                       # the default variants at the default shapes
    python benchmarks/kda_tuning.py --shapes 16x2048x12x64 --variant "8 warps:main_bwd_warps=8"
    python benchmarks/kda_tuning.py --from_json F                    # the section from a stored run

Per shape (B x T x H x D, K = V = D), the default settings first, then each variant with
``k3lit.kernels.kda.plan.TUNING`` updated by its ``key=value`` pairs: the forward without gradients and the
forward + backward from raw bf16 q, k, v, the gate pre-activation e and float32 beta, with the gate ``g_min sigmoid(e +
bias)`` and the q/k L2 norm inside the kernels (what :class:`k3lit.nn.kda.KimiDeltaAttention` runs), timed side by
side in one process (``triton.testing.do_bench`` medians). A launch setting tiles the same computation otherwise;
each variant's output and gradients are compared with the default's (the largest relative RMS difference over o,
dq, dk, dv, de, dbeta and the bias gradient), so a variant that changes what the op computes beyond float32
summation order shows.

The default shapes are ``small``'s KDA layers (B16 T2048 H12 D64) and ``benchmarks/kda.py``'s first shape; the
default variants are the settings that keep ``_main_bwd`` and ``_prep_fwd`` from spilling registers at D = 64 with
the fused gate and L2 norm (``benchmarks/kernel_resources.py``).
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.results import (  # noqa: E402
    add_output_arguments,
    add_shapes_argument,
    command,
    environment,
    gpu_run_or_load,
    versions,
)
from k3lit.kernels.kda import kda_triton, plan  # noqa: E402
from k3lit.testing import rel_rms  # noqa: E402

G_MIN = -5.0
SHAPES = ((16, 2048, 12, 64), (8, 2048, 16, 128))
VARIANTS = ("main_bwd 8 warps:main_bwd_warps=8", "main_bwd 8 warps, 32-wide values:main_bwd_warps=8,main_bwd_bv=32",
            "prep 2 warps:prep_warps=2", "prep 2 warps, main_bwd 8 warps:prep_warps=2,main_bwd_warps=8")


def parse_variant(spec: str) -> tuple[str, dict]:
    """``"label:key=value[,key=value]"`` -> ``(label, settings)``; every key must be a ``plan.TUNING`` key, values
    are Python literals (``8``, ``None``, ``'split'``) or bare words (``split``).

    Raises:
        SystemExit: a malformed spec or an unknown key, naming the keys there are.
    """
    label, sep, body = spec.partition(":")
    settings = {}
    for item in filter(None, body.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key.strip() not in plan.TUNING:
            raise SystemExit(f"--variant {spec!r}: write LABEL:key=value[,key=value] with keys from "
                             f"{sorted(plan.TUNING)}")
        try:
            settings[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            settings[key.strip()] = value.strip()
    if not sep or not label or not settings:
        raise SystemExit(f"--variant {spec!r}: write LABEL:key=value[,key=value]")
    return label, settings


def layer_op(q, k, v, e, beta, bias):  # noqa: ANN001, ANN201
    """The KDA op with the gate and the q/k L2 norm in the kernels, as the layer calls it: ``o [B, T, H, V]``."""
    return kda_triton(q, k, v, e, beta, g_min=G_MIN, use_gate_in_kernel=True, gate_bias=bias,
                      use_qk_l2norm_in_kernel=True)[0]


def inputs(B: int, T: int, H: int, D: int, device: str) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Raw bf16 q, k, v and e, float32 beta (as the layer forms it) and a float32 gate bias ``[H D]``, all requiring
    grad, and a bf16 output gradient."""
    g = torch.Generator(device=device).manual_seed(0)

    def draw(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return scale * torch.randn(*shape, device=device, generator=g)

    xs = [draw(B, T, H, D, scale=2), draw(B, T, H, D), draw(B, T, H, D), draw(B, T, H, D, scale=2)]
    xs = [x.bfloat16() for x in xs] + [torch.sigmoid(draw(B, T, H)), draw(H * D)]
    return [x.requires_grad_() for x in xs], draw(B, T, H, D).bfloat16()


def run(xs: list[torch.Tensor], do: torch.Tensor) -> list[torch.Tensor]:
    """``[o, dq, dk, dv, de, dbeta, dbias]`` of one forward + backward."""
    o = layer_op(*xs)
    return [o.detach(), *torch.autograd.grad(o, xs, do)]


def gpu_bench(fn) -> float:  # noqa: ANN001
    """Median milliseconds of ``fn`` by ``triton.testing.do_bench``."""
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=200)


def measure(a: argparse.Namespace, device: str = "cuda", bench=gpu_bench) -> dict:  # noqa: ANN001
    """Times of the default settings and of every variant of ``a.variants`` at every shape of ``a.shapes`` on
    ``device``, timed by ``bench(fn) -> ms`` (the tests run it on the CPU, with the kernels under
    ``TRITON_INTERPRET=1``); ``plan.TUNING`` is restored after each variant."""
    variants = [("default", {})] + [parse_variant(s) for s in a.variants]
    out = {"env": versions(), "command": command(), "shapes": []}
    default = dict(plan.TUNING)
    for B, T, H, D in a.shapes:
        xs, do = inputs(B, T, H, D, device)
        rows = []
        for label, settings in variants:
            plan.TUNING.update(settings)
            try:
                got = run(xs, do)  # compiles the variant's kernels outside the timing
                with torch.no_grad():
                    fwd = bench(lambda xs=xs: layer_op(*xs))
                fwd_bwd = bench(lambda xs=xs, do=do: run(xs, do))
            except Exception as e:  # a setting that does not compile (shared memory) or does not apply
                if not settings:
                    raise
                rows.append({"label": label, "settings": settings, "error": f"{type(e).__name__}: {str(e)[:100]}"})
                continue
            finally:
                plan.TUNING.clear()
                plan.TUNING.update(default)
            if not settings:  # the default, first
                base = got
            diff = max(rel_rms(x, y) for x, y in zip(got, base, strict=True))
            rows.append({"label": label, "settings": settings, "fwd_ms": fwd, "fwd_bwd_ms": fwd_bwd, "diff": diff})
            print(f"{B}x{T}x{H}x{D} {label}: {rows[-1]}", flush=True)
        out["shapes"].append({"B": B, "T": T, "H": H, "D": D, "rows": rows})
    return out


def table(r: dict) -> str:
    """The section: one row per shape and setting, the times relative to the default's."""
    lines = [f"Written by `benchmarks/kda_tuning.py`. {environment(r['env'])}. Command: {r['command']}. The KDA op "
             "from raw bf16 q, k, v, e and float32 beta with the gate and the q/k L2 norm in the kernels, as the KDA "
             "layer calls it; `fwd`: without gradients; `f+b`: forward and backward; median ms of "
             "`triton.testing.do_bench`, "
             "every row in one process. `difference`: the largest relative RMS difference of the output and the "
             "gradients from the default settings' (a launch setting tiles the same computation).", "",
             "| B x T x H x D | settings | fwd ms | f+b ms | f+b / default | difference |", "|---|---|---|---|---|---|"]
    for shape in r["shapes"]:
        name = f"{shape['B']} x {shape['T']} x {shape['H']} x {shape['D']}"
        base = shape["rows"][0]  # the default settings' (measure raises if they fail)
        for row in shape["rows"]:
            what = row["label"] + ("" if not row["settings"] else " (" + ", ".join(
                f"`{k}={v}`" for k, v in row["settings"].items()) + ")")
            if "error" in row:
                lines.append(f"| {name} | {what} | - | - | - | failed: {row['error']} |")
                continue
            lines.append(f"| {name} | {what} | {row['fwd_ms']:.3f} | {row['fwd_bwd_ms']:.3f} | "
                         f"{row['fwd_bwd_ms'] / base['fwd_bwd_ms']:.3f} | "
                         f"{row['diff']:.1e} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shapes_argument(p, SHAPES, "B x T x H x D")
    p.add_argument("--variant", dest="variants", action="append", default=None,
                   help="LABEL:key=value[,key=value] of plan.TUNING, repeatable (default: the built-in variants)")
    add_output_arguments(p, "raw results")
    a = p.parse_args()
    a.variants = list(VARIANTS) if a.variants is None else a.variants
    for spec in a.variants:
        parse_variant(spec)  # refuse a bad spec before any GPU work
    gpu_run_or_load(a, measure, "KDA launch settings", table)


if __name__ == "__main__":
    main()
