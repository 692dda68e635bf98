#!/usr/bin/env bash
# The GPU measurements behind benchmarks/RESULTS.md, in the order that keeps the GPU free for every timing: the
# GPU tests and fla's compile workers first (they share the GPU, but time nothing), then each benchmark alone. Each
# benchmark writes its own RESULTS.md section; logs go to $LOGS. The steps other than the sweep took about 9-10
# minutes on one H200 when run one by one in sessions 4-5 (tests 3.5 minutes, kda with its workers ~8.5 in session
# 9); a device call allows 10 minutes, so name the steps to run in each call (and write the logs where the call
# returns files):
#
#   bash benchmarks/gpu_suite.sh                      # every step, from the repository root (k3lit, fla importable)
#   bash benchmarks/gpu_suite.sh tests                # only these steps
#   LOGS=$OUT/gpu TRITON_CACHE_DIR=/tmp/tc bash benchmarks/gpu_suite.sh kda fused
#
# Steps: tests (GPU tests of kernels, model, nn), kda (section "KDA kernels", with fla; starts six fla compile
# workers beside the tests, twelve ran a 140 GB H200 out of memory), fused ("KDA with fused gate and q/k L2 norm"),
# sweep (the forward alternatives of plan.TUNING around the defaults, kda_breakdown.FORWARD_VARIANTS: the split
# per-chunk kernels, the one kernel's warps and steps, bf16 U, the scan writing the output, pipeline segments forced
# on and off; to $LOGS/kda_sweep.json, rewritten after each shape; $LOGS/kda_sweep.log has each line as it is timed;
# 18 variants at 8 shapes took ~4 minutes in session 9), attnres
# ("Attention residuals × checkpointing (<GPU>, 300m, batch 8)"), mix ("Attention residuals: depth-mix kernel
# (<GPU>)"), throughput ($LOGS/throughput_small.json; write its section with `python benchmarks/throughput.py
# --from_json ...`).
set -u
cd "$(git rev-parse --show-toplevel)"
LOGS=${LOGS:-/tmp/k3lit-gpu}
mkdir -p "$LOGS"
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$LOGS/triton-cache}
STEPS=" ${*:-tests kda fused sweep attnres mix throughput} "
t0=$(date +%s)
stamp() { echo "[$1: $(( $(date +%s) - t0 )) s]"; }
want() { [[ "$STEPS" == *" $1 "* ]]; }
for s in $STEPS; do
  case $s in tests|kda|fused|sweep|attnres|mix|throughput) ;; *) echo "unknown step '$s' (steps: tests kda fused sweep \
attnres mix throughput)" >&2; exit 2 ;; esac
done

if want kda; then
  for i in $(seq 0 5); do python benchmarks/kda.py --fla-compile-worker "$i/6" > "$LOGS/worker$i.log" 2>&1 & done
fi
if want tests; then
  timeout 360 python -m pytest -q -m gpu tests/kernels tests/test_model.py tests/nn -p no:cacheprovider \
    > "$LOGS/pytest.log" 2>&1
  stamp "GPU tests: $(tail -1 "$LOGS/pytest.log")"
fi
if want kda; then
  wait
  stamp "fla compile workers"
  timeout 420 python benchmarks/kda.py > "$LOGS/kda.log" 2>&1; stamp "kda.py (rc $?)"
fi
if want fused; then
  timeout 120 python benchmarks/kda.py --fused-inputs --no-fla > "$LOGS/fused.log" 2>&1
  stamp "kda.py --fused-inputs (rc $?)"
fi
if want sweep; then
  timeout 540 python benchmarks/kda_breakdown.py --shapes 8x2048x16x128 2x8192x16x128 1x65536x16x128 \
    1x8192x96x128 8x2048x32x256 --sweep --no-breakdown --variants forward --json "$LOGS/kda_sweep.json" \
    > "$LOGS/kda_sweep.log" 2>&1
  stamp "kda_breakdown.py --sweep --variants forward (rc $?)"
fi
if want attnres; then
  timeout 150 python benchmarks/attnres.py speed --size 300m --batch 8 --repeats 3 --residuals plain block_attnres \
    --policies none block block:7 > "$LOGS/attnres.log" 2>&1; stamp "attnres.py (rc $?)"
fi
if want mix; then
  timeout 150 python benchmarks/attnres.py mix --batch 8 --sources 6 11 --sweep > "$LOGS/mix.log" 2>&1
  stamp "attnres.py mix (rc $?)"
fi
if want throughput; then
  timeout 150 python benchmarks/throughput.py --recipe recipes/small.yaml --json "$LOGS/throughput_small.json" \
    --lightning "$LOGS/lightning" > "$LOGS/throughput.log" 2>&1; stamp "throughput.py (rc $?)"
fi
if want kda; then grep -h "^| \|Target" "$LOGS/kda.log" | tail -12; fi
if want sweep; then grep -h "^sweep" "$LOGS/kda_sweep.log" | cut -c1-160; fi
