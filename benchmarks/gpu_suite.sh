#!/usr/bin/env bash
# The GPU measurements behind benchmarks/RESULTS.md, in the order that keeps the GPU free for every timing: the
# GPU tests and fla's compile workers first (they share the GPU, but time nothing), then each benchmark alone. Each
# benchmark writes its own RESULTS.md section; logs go to $LOGS. On one H200 the tests took about 3.5 minutes before
# tests/train's GPU fits joined them (not timed yet), and kda with its compile workers about 8.5 on an empty Triton
# cache; first_call with fla takes up to 14 minutes (its fla processes are given 420 s each). Name the steps to run when a call has a time limit (and write the logs
# where the call returns files):
#
#   bash benchmarks/gpu_suite.sh                      # every step, from the repository root (k3lit, fla importable)
#   bash benchmarks/gpu_suite.sh tests                # only these steps
#   LOGS=$OUT/gpu TRITON_CACHE_DIR=/tmp/tc bash benchmarks/gpu_suite.sh kda fused
#
# Steps and the sections they write: tests (GPU tests of kernels, model, nn; no section), kda ("KDA kernels", with
# fla; starts six fla compile workers beside the tests, twelve run a 140 GB H200 out of memory), fused ("KDA with
# fused gate and q/k L2 norm"), accuracy ("KDA accuracy over draws"), first_call ("KDA first call"), attnres
# ("Attention residuals × checkpointing (<GPU>, 300m, batch 8)"), mix ("Attention residuals: depth-mix kernel
# (<GPU>)"), short_conv ("Short convolution (<GPU>)", with fla and the tiling sweep), kda_tuning ("KDA launch
# settings (<GPU>)": the KDA op at `small`'s and kda.py's first shape under alternative launch settings), moe
# ("MoE: experts and balancing overhead"), throughput ($LOGS/throughput_small.json; write its
# section with `python benchmarks/throughput.py --from_json ...`), startup ("Start-up (<GPU>)": `small` on empty and
# warm compile caches; prepares the python corpus first, about 95 s).
set -u
cd "$(git rev-parse --show-toplevel)"
LOGS=${LOGS:-/tmp/k3lit-gpu}
mkdir -p "$LOGS"
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$LOGS/triton-cache}
ALL="tests kda fused accuracy first_call attnres mix short_conv kda_tuning moe throughput startup"
STEPS=" ${*:-$ALL} "
t0=$(date +%s)
stamp() { echo "[$1: $(( $(date +%s) - t0 )) s]"; }
want() { [[ "$STEPS" == *" $1 "* ]]; }
for s in $STEPS; do
  [[ " $ALL " == *" $s "* ]] || { echo "unknown step '$s' (steps: $ALL)" >&2; exit 2; }
done

if want kda; then
  for i in $(seq 0 5); do python benchmarks/kda.py --fla-compile-worker "$i/6" > "$LOGS/worker$i.log" 2>&1 & done
fi
if want tests; then
  timeout 540 python -m pytest -q -m gpu tests/kernels tests/test_model.py tests/nn tests/train -p no:cacheprovider \
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
if want accuracy; then
  timeout 300 python benchmarks/kda_accuracy.py --json "$LOGS/kda_accuracy.json" > "$LOGS/accuracy.log" 2>&1
  stamp "kda_accuracy.py (rc $?)"
fi
if want first_call; then
  timeout 900 python benchmarks/kda_first_call.py --json "$LOGS/kda_first_call.json" > "$LOGS/first_call.log" 2>&1
  stamp "kda_first_call.py (rc $?)"
fi
if want attnres; then
  timeout 150 python benchmarks/attnres.py speed --size 300m --batch 8 --repeats 3 --residuals plain block_attnres \
    --policies none block block:7 > "$LOGS/attnres.log" 2>&1; stamp "attnres.py (rc $?)"
fi
if want mix; then
  timeout 150 python benchmarks/attnres.py mix --batch 8 --sources 6 11 --sweep > "$LOGS/mix.log" 2>&1
  stamp "attnres.py mix (rc $?)"
fi
if want short_conv; then
  timeout 420 python benchmarks/short_conv.py --sweep --json "$LOGS/short_conv.json" > "$LOGS/short_conv.log" 2>&1
  stamp "short_conv.py (rc $?)"
fi
if want kda_tuning; then
  timeout 300 python benchmarks/kda_tuning.py --json "$LOGS/kda_tuning.json" > "$LOGS/kda_tuning.log" 2>&1
  stamp "kda_tuning.py (rc $?)"
fi
if want moe; then
  timeout 300 python benchmarks/moe.py --json "$LOGS/moe.json" > "$LOGS/moe.log" 2>&1; stamp "moe.py (rc $?)"
fi
if want throughput; then
  timeout 150 python benchmarks/throughput.py --recipe recipes/small.yaml --json "$LOGS/throughput_small.json" \
    --lightning "$LOGS/lightning" > "$LOGS/throughput.log" 2>&1; stamp "throughput.py (rc $?)"
fi
if want startup; then
  timeout 540 python benchmarks/startup.py --recipes recipes/small.yaml --out "$LOGS/startup" \
    --json "$LOGS/startup_h200.json" > "$LOGS/startup.log" 2>&1; stamp "startup.py (rc $?)"
fi
if want kda; then grep -h "^| \|Target" "$LOGS/kda.log" | tail -12; fi
