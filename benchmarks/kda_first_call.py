"""KDA first-call time: how long a user waits at a shape the process has not run before.

Triton compiles a kernel the first time it meets a new specialisation (new constexprs, or an integer argument
that changes its divisibility by 16), and a library that autotunes also compiles and times every candidate
config there. This script measures the wall time of one bf16 forward+backward at a sequence of shapes, each new to
the process, for k3lit's kernels and for fla's ``chunk_kda(safe_gate=True, lower_bound=-5)``:

1. ``cold``: a new process with an empty ``TRITON_CACHE_DIR`` (everything compiled, fla autotuned);
2. a new sequence length (T not a multiple of 16 or of the chunk), 3. a new batch size, 4. a new head size
   (K = V = 60, not a power of two);

and then the same sequence in a second process on the cache the first one filled (``cached``: what every later
run on the same software pays). Each step reports the first call and, for contrast, a second call at the same
shape (``warm``). Each implementation runs in its own child processes, one after the other, so compilations never
share the CPU; fla's get ``--fla-timeout`` seconds each (a step it did not reach is reported as such). The table
goes to ``benchmarks/RESULTS.md``, section "KDA first call".

    python benchmarks/kda_first_call.py [--no-fla] [--fla-timeout 420] [--json first_call.json]
    python benchmarks/kda_first_call.py --from-json benchmarks/kda_first_call_h200.json   # the stored H200 run

``--device cpu`` runs k3lit's kernels under ``TRITON_INTERPRET=1`` at small shapes (the script's own check; the
times mean nothing there).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.results import command, environment, load_json, versions, write_section  # noqa: E402

#: (label, B, T, H, D) on the GPU; each shape is new to the process when it runs.
STEPS = [("cold", 2, 4096, 16, 128), ("new T", 2, 4100, 16, 128), ("new B", 3, 4096, 16, 128),
         ("new head size", 2, 4096, 16, 60)]
#: the same sequence at interpreter scale (``--device cpu``).
CPU_STEPS = [("cold", 1, 40, 2, 32), ("new T", 1, 37, 2, 32), ("new B", 2, 40, 2, 32), ("new head size", 1, 40, 2, 20)]


def steps_for(device: str) -> list[tuple[str, int, int, int, int]]:
    """:data:`STEPS` on the GPU, :data:`CPU_STEPS` on the CPU."""
    return CPU_STEPS if device == "cpu" else STEPS


def child(impl: str, device: str) -> None:
    """Run :data:`STEPS` (``CPU_STEPS`` on the CPU) with ``impl`` ("k3lit" or "fla") in this process, printing one
    JSON line per step as it finishes: ``{"step", "shape", "first_s", "warm_s"}``."""
    import torch

    from benchmarks.kda import inputs, load_fla, make_fla, ours

    fn = ours if impl == "k3lit" else make_fla(load_fla())
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    torch.ones(1, device=device).sum().item()  # device context outside the timing

    def call(xs, do):
        sync()
        t0 = time.perf_counter()
        o, _ = fn(*xs)
        o.backward(do)
        sync()
        return time.perf_counter() - t0

    for label, B, T, H, D in steps_for(device):
        xs = inputs(B, T, H, D, D, device=device, requires_grad=True)
        do = torch.randn(B, T, H, D, device=device, dtype=xs[0].dtype)
        first = call(xs, do)
        warm = call(xs, do)
        print(json.dumps({"step": label, "shape": [B, T, H, D], "first_s": first, "warm_s": warm}), flush=True)


def run_child(impl: str, device: str, cache: str, timeout: float) -> tuple[list[dict], str | None]:
    """One child process of :func:`child` on Triton cache ``cache``: (its step records, why it stopped early or
    None)."""
    env = dict(os.environ, TRITON_CACHE_DIR=cache, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get(
        "PYTHONPATH")])))
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    cmd = [sys.executable, os.path.abspath(__file__), "--child", impl, "--device", device]
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        out, stopped = p.stdout, None if p.returncode == 0 else f"exit {p.returncode}: {p.stderr.strip()[-300:]}"
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        stopped = f"timed out after {timeout:.0f} s"
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")], stopped


def measure(impls: list[str], device: str, timeouts: dict[str, float]) -> dict:
    """``{impl: {"cold" | "cached": {"steps": [...], "stopped": str | None}}}``: each impl's steps in a process on
    an empty Triton cache, then in a second process on the cache the first filled."""
    results = {}
    for impl in impls:
        with tempfile.TemporaryDirectory(prefix=f"kda-first-call-{impl}-") as cache:
            results[impl] = {}
            for run in ("cold", "cached"):
                steps, stopped = run_child(impl, device, cache, timeouts[impl])
                results[impl][run] = {"steps": steps, "stopped": stopped}
                print(f"{impl} {run}: {steps} {stopped or ''}", flush=True)
    return results


def _s(seconds: float) -> str:
    return f"{seconds:.1f}" if seconds >= 10 else f"{seconds:.2f}" if seconds >= 1 else f"{seconds:.3f}"


def table(results: dict) -> list[str]:
    """Markdown rows: one per implementation and process, a column per step (``—`` for a step the process did
    not reach)."""
    labels = [s[0] for s in STEPS]
    lines = ["| impl | process | " + " | ".join(f"{lab} first / warm s" for lab in labels) + " |",
             "|---|---|" + "---|" * len(labels)]
    for impl, runs in results.items():
        for run, r in runs.items():
            got = {s["step"]: s for s in r["steps"]}
            cells = [f"{_s(got[lab]['first_s'])} / {_s(got[lab]['warm_s'])}" if lab in got else "—" for lab in labels]
            note = f" ({r['stopped']})" if r["stopped"] else ""
            lines.append(f"| {impl} | {run}{note} | " + " | ".join(cells) + " |")
    return lines


def section(meta: dict, results: dict, steps: list) -> str:
    """The RESULTS.md section from :func:`measure`'s ``results`` at ``steps`` and ``meta``
    (:func:`benchmarks.results.versions` of the measuring process, with ``"fla"``, fla's version, where fla ran, and
    ``"command"``, its command line)."""
    shapes = ", ".join(f"{lab} B{B} T{T} H{H} D{D}" for lab, B, T, H, D in steps)
    return "\n".join([
        f"Written by `benchmarks/kda_first_call.py`. {environment(meta)}"
        + (f" · fla-core {meta['fla']}" if "fla" in meta else "")
        + "." + (f" Command: {meta['command']}." if "command" in meta else ""), "",
        "Wall seconds of one bf16 forward+backward at a shape new to the process (first) and of a second call at it "
        f"(warm), in this order: {shapes}. `cold`: a new process on an empty TRITON_CACHE_DIR; `cached`: a second "
        "process on the cache the first one filled. fla: `chunk_kda(safe_gate=True, lower_bound=-5)`, autotuned by "
        "its own autotuner.", "", *table(results)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", choices=("k3lit", "fla"), help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--timeout", type=float, default=240, help="seconds for each k3lit process")
    ap.add_argument("--fla-timeout", type=float, default=420, help="seconds for each fla process")
    ap.add_argument("--json", help="also write the raw records here")
    ap.add_argument("--from-json", "--from_json",
                    help="write the section from the records of an earlier run (no timing)")
    ap.add_argument("--results", default=os.path.join(ROOT, "benchmarks", "RESULTS.md"))
    args = ap.parse_args()
    if args.child:
        child(args.child, args.device)
        return
    if args.from_json:
        stored = load_json(args.from_json, ("versions", "results", "steps"))
        body = section(stored["versions"], stored["results"], stored["steps"])
        write_section("KDA first call", body, args.results)
        print(body)
        return
    impls = ["k3lit"] + ([] if args.no_fla or args.device == "cpu" else ["fla"])
    results = measure(impls, args.device, {"k3lit": args.timeout, "fla": args.fla_timeout})
    meta = versions() | {"command": command()} | ({"fla": __import__("fla").__version__} if "fla" in impls else {})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"versions": meta, "steps": steps_for(args.device), "results": results}, f, indent=1)
    body = section(meta, results, steps_for(args.device))
    if args.device == "cuda":
        write_section("KDA first call", body, args.results)
    print(body)


if __name__ == "__main__":
    main()
