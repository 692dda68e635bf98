"""Warp instructions that the KDA forward's per-chunk kernel ``_prep_fwd`` issues per chunk and head, counted in its
sm_90a machine code (CPU; no GPU needed).

The kernel is compiled for the H200 as a real launch would be (``k3lit.kernels.aot``), disassembled with the
``nvdisasm`` that Triton ships (with line information), and every backward branch is taken as a loop. Each loop
is matched to the Python loop in ``kernels/kda/chunk_fwd.py`` whose ``for`` line its instructions carry most often (else
whose body's lines), which gives its trip
count: the intra-chunk products and the W columns ``cdiv(K, BK)``, the U columns ``cdiv(V, BV)``, the inverse's
substitution ``inverse_block - 1``. Instructions per chunk and head = the static count + (trips - 1) x each matched
loop body. Unmatched loops count once (say so in the output). One warp runs each program, so this is the work of a
warp per chunk and head; Nsight Compute found the kernel issue- and latency-bound (benchmarks/RESULTS.md), so
fewer instructions is what makes it faster.

    python benchmarks/kda_sass.py [--shape 8x2048x16x128] [--save] [--json counts.json]
    python benchmarks/kda_sass.py --scan [--shape 1x16384x16x128] [--tuning '{"fwd_bv": 32}'] [--json counts.json]

``--scan`` counts instead the body of the forward state scan's chunk loop (``_scan_fwd``, or ``_scan_fwd_t`` where
``plan._scan_plan`` picks it at the shape): one trip per chunk, split by opcode (tensor-core products, barriers,
asynchronous and plain global loads). One program of 4 warps runs each (sequence, head, value block); Nsight Compute
found it issuing every 6.5-7.2 cycles at one warp per scheduler (benchmarks/RESULTS.md, "KDA launch settings").

Must run without ``TRITON_INTERPRET``. Counts differ between Triton versions (printed).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.kernel_resources import _kda  # noqa: E402
from k3lit.kernels import aot  # noqa: E402

#: The variants counted by default: ``plan.TUNING`` updates.
VARIANTS = {"default (16-wide inverse blocks)": {}, "inverse by substitution": dict(inverse_block=32),
            "inverse 8": dict(inverse_block=8), "inverse 4": dict(inverse_block=4)}
_INS = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^\.(L_x_\d+):")
_LINE = re.compile(r'//## File ".*?", line (\d+)')
_BACK = re.compile(r"BRA\s+`\(\.(L_x_\d+)\)")


@dataclass
class Loop:
    """A loop of the machine code: its body's instruction count, the Python loop it matched (or None) and the
    trips that loop makes per program."""

    size: int
    python_loop: str | None
    trips: int


def disassemble(cubin: bytes) -> list[tuple[str, int | None, str | None]]:
    """``(instruction, source line, label)`` per instruction of a cubin (label: one that names this address)."""
    import triton

    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([nvdisasm, "-c", "-g", f.name], capture_output=True, text=True, check=True).stdout
    out, line, label = [], None, None
    for raw in text.splitlines():
        if m := _LINE.search(raw):
            line = int(m.group(1))
        elif m := _LABEL.match(raw.strip()):
            label = m.group(1)
        elif m := _INS.match(raw):
            out.append((m.group(2), line, label))
            label = None
    return out


def python_loops(trips: dict[str, int]) -> dict[str, tuple[int, int, int]]:
    """``{name: (first line, last line, trips)}`` of the Python loops of chunk.py that ``_prep_fwd`` runs: the
    ``n``-th ``for`` of a function is named ``function#n``, and ``trips`` gives each name's trip count."""
    from k3lit.kernels.kda import chunk_fwd

    tree = ast.parse(inspect.getsource(chunk_fwd))
    found = {}
    for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef)):
        fors = [n for n in ast.walk(fn) if isinstance(n, ast.For)]
        for i, node in enumerate(sorted(fors, key=lambda n: n.lineno)):
            name = f"{fn.name}#{i}"
            if name in trips:
                found[name] = (node.lineno, node.end_lineno, trips[name])
    return found


def machine_loops(ins: list[tuple[str, int | None, str | None]]) -> list[tuple[int, int]]:
    """``(first, last)`` instruction index of every loop of :func:`disassemble`'s output: a branch back to a label."""
    labels = {lab: i for i, (_, _, lab) in enumerate(ins) if lab}
    return [(labels[m.group(1)], i) for i, (text, _, _) in enumerate(ins)
            if (m := _BACK.search(text)) and labels.get(m.group(1), i) < i]


def count(B: int, T: int, H: int, D: int, tuning: dict, save: bool) -> tuple[int, int, list[Loop]]:
    """``(instructions per chunk and head, static instructions, loops)`` of ``_prep_fwd`` at this shape, bf16
    inputs, with ``tuning`` applied to ``plan.TUNING``."""
    launch = _kda(B, T, H, D, D, False, False, only=("_prep_fwd",), tuning=tuning, save=save)[0]
    kw = launch.kwargs  # the constexprs the launcher chose
    ins = disassemble(aot.compile_kernel(launch).asm["cubin"])
    k_steps, v_steps = -(-kw["K"] // kw["BK"]), -(-kw["V"] // kw["BV"])
    named = python_loops({"_intra_chunk#0": k_steps, "_inverse#0": kw["INV_BLOCK"] - 1, "_wy_chunk#0": k_steps,
                          "_wy_chunk#1": v_steps})
    loops, total = [], len(ins)
    for lo, hi in machine_loops(ins):
        body = ins[lo:hi + 1]
        # the loop's own instructions (induction, branch) carry the ``for`` line; ptxas attributes some inlined
        # arithmetic to other lines of the kernel, so the body's lines decide only where no ``for`` line appears
        votes = Counter(name for _, line, _ in body for name, (lo, _, _) in named.items() if line == lo)
        votes = votes or Counter(name for _, line, _ in body for name, (lo, hi, _) in named.items()
                                 if line is not None and lo <= line <= hi)
        name = votes.most_common(1)[0][0] if votes else None
        trips = named[name][2] if name else 1
        loops.append(Loop(len(body), name, trips))
        total += (trips - 1) * len(body)
    return total, len(ins), loops


def _read_next_trip(body: list[str], i: int) -> bool:
    """Whether the register that instruction ``i`` of a loop body loads is first read on the loop's next trip:
    going round the body from ``i``, the first instruction that mentions it reads it (the register appears among
    its source operands, after the first comma) and lies before ``i``. A register overwritten before any read is
    not read at all (False)."""
    dest = re.search(r"\s(R\d+)", body[i]).group(1)
    mention = re.compile(rf"\b{dest}\b")
    for j in list(range(i + 1, len(body))) + list(range(i)):
        if mention.search(body[j]):
            _, _, sources = body[j].partition(",")
            return j < i and bool(mention.search(sources))
    return False


def scan_loop(B: int, T: int, H: int, D: int, save: bool, tuning: dict | None = None
              ) -> tuple[str, int, Counter, list[bool]]:
    """``(kernel, instructions, opcodes, ahead)`` of the forward scan's largest loop, its chunk loop, at this shape
    (bf16, K = V = D; ``tuning`` applied to ``plan.TUNING``): the body's instruction count, a count per opcode
    (``LDG`` only for plain global loads) and, per plain global load, whether its value is first read on the next
    trip (loaded a chunk ahead)."""
    launch = _kda(B, T, H, D, D, False, False, only=("_scan_fwd", "_scan_fwd_t"), save=save, tuning=tuning)[0]
    ins = disassemble(aot.compile_kernel(launch).asm["cubin"])
    lo, hi = max(machine_loops(ins), key=lambda ab: ab[1] - ab[0])
    body = [text for text, _, _ in ins[lo:hi + 1]]
    names = [re.split(r"[ .]", re.sub(r"^@!?U?P\w+\s+", "", text))[0] for text in body]
    ahead = [_read_next_trip(body, i) for i, name in enumerate(names) if name == "LDG"]
    return launch.name, len(body), Counter(names), ahead


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="8x2048x16x128", help="BxTxHxD (K = V = D)")
    p.add_argument("--save", action="store_true", help="the forward that saves for a backward")
    p.add_argument("--json", help="also write the counts to this path")
    p.add_argument("--scan", action="store_true", help="count the forward scan's chunk loop instead")
    p.add_argument("--tuning", type=json.loads, default=None, metavar="JSON",
                   help='with --scan: plan.TUNING updates, e.g. \'{"fwd_scan": "plain"}\'')
    args = p.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: the kernels must be compilable JIT functions")
    import triton

    B, T, H, D = (int(x) for x in args.shape.split("x"))
    if args.scan:
        name, size, ops, ahead = scan_loop(B, T, H, D, args.save, args.tuning)
        keys = ("HMMA", "HGMMA", "BAR", "LDGSTS", "LDG")
        print(f"{name}, sm_90a, triton {triton.__version__}, B{B} T{T} H{H} D{D}: chunk loop {size} instructions, "
              + ", ".join(f"{k} {ops[k]}" for k in keys) + f"; plain loads read on the next trip: {ahead}")
        if args.json:
            Path(args.json).write_text(json.dumps(dict(kernel=name, size=size, ops=dict(ops), ahead=ahead), indent=1))
        return
    print(f"_prep_fwd, sm_90a, triton {triton.__version__}, B{B} T{T} H{H} D{D}, "
          f"{'saving for a backward' if args.save else 'no backward'}: warp instructions per chunk and head")
    print("| variant | per chunk and head | static | loops (body x trips, Python loop) |")
    print("|---|---:|---:|---|")
    rows = {}
    for label, tuning in VARIANTS.items():
        total, static, loops = count(B, T, H, D, tuning, args.save)
        desc = ", ".join(f"{lp.size} x {lp.trips} ({lp.python_loop or 'unmatched, counted once'})" for lp in loops)
        print(f"| {label} | {total} | {static} | {desc} |", flush=True)
        rows[label] = dict(total=total, static=static, loops=[dataclasses.asdict(lp) for lp in loops])
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
