#!/usr/bin/env bash
# The GPU measurements behind benchmarks/RESULTS.md in one run (its commands took about 9-10 minutes
# on one H200, run one by one in sessions 4-5; the script as a whole has not run yet), in the order that
# keeps the GPU free for every timing: the GPU tests and fla's compile workers first (they share the GPU, but
# time nothing), then each benchmark alone. Each benchmark writes its own RESULTS.md section; logs go to $LOGS.
#
#   bash benchmarks/gpu_suite.sh            # from the repository root, with k3lit and fla importable
#   LOGS=/tmp/k3lit-gpu bash benchmarks/gpu_suite.sh
#
# Sections written: "KDA kernels", "KDA with fused gate and q/k L2 norm", "Attention residuals × checkpointing
# (<GPU>, 300m, batch 8)", "Attention residuals: depth-mix kernel (<GPU>)"; the throughput JSON goes to
# $LOGS/throughput_small.json (write its section with `python benchmarks/throughput.py --from_json ...`), the KDA
# launch-setting sweep of the forward alternatives not yet timed on a GPU (kda_breakdown.FORWARD_VARIANTS: pipeline
# segments, fewer bytes, 32-wide forward blocks) to $LOGS/kda_sweep.json. Six compile
# workers: twelve ran a 140 GB H200 out of memory.
set -u
cd "$(git rev-parse --show-toplevel)"
LOGS=${LOGS:-/tmp/k3lit-gpu}
mkdir -p "$LOGS"
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$LOGS/triton-cache}
t0=$(date +%s)
stamp() { echo "[$1: $(( $(date +%s) - t0 )) s]"; }

for i in $(seq 0 5); do python benchmarks/kda.py --fla-compile-worker "$i/6" > "$LOGS/worker$i.log" 2>&1 & done
timeout 300 python -m pytest -q -m gpu tests/kernels tests/test_model.py tests/nn -p no:cacheprovider > "$LOGS/pytest.log" 2>&1
stamp "GPU tests: $(tail -1 "$LOGS/pytest.log")"
wait
stamp "fla compile workers"
timeout 420 python benchmarks/kda.py > "$LOGS/kda.log" 2>&1; stamp "kda.py (rc $?)"
timeout 120 python benchmarks/kda.py --fused-inputs --no-fla > "$LOGS/fused.log" 2>&1; stamp "kda.py --fused-inputs (rc $?)"
timeout 420 python benchmarks/kda_breakdown.py --shapes 8x2048x16x128 2x8192x16x128 1x65536x16x128 1x8192x96x128 \
  8x2048x32x256 --sweep --no-breakdown --variants forward --json "$LOGS/kda_sweep.json" > "$LOGS/kda_sweep.log" 2>&1
stamp "kda_breakdown.py --sweep --variants forward (rc $?)"
timeout 150 python benchmarks/attnres.py speed --size 300m --batch 8 --repeats 3 --residuals plain block_attnres \
  --policies none block block:7 > "$LOGS/attnres.log" 2>&1; stamp "attnres.py (rc $?)"
timeout 150 python benchmarks/attnres.py mix --batch 8 --sources 6 11 --sweep > "$LOGS/mix.log" 2>&1; stamp "attnres.py mix (rc $?)"
timeout 150 python benchmarks/throughput.py --recipe recipes/small.yaml --json "$LOGS/throughput_small.json" \
  --lightning "$LOGS/lightning" > "$LOGS/throughput.log" 2>&1; stamp "throughput.py (rc $?)"
grep -h "^| \|Target" "$LOGS/kda.log" | tail -12
