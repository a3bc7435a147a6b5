#!/usr/bin/env bash
# Rerun every CPU benchmark, one after another, each writing its JSON to benchmarks/results/; log the machine, the
# date and every command to benchmarks/results/run_all-DATE.log; then benchmarks/summarize.py rewrites the generated
# summary of RESULTS.md (and README.md's copy of its headline table) from the newest record of each benchmark,
# with its machine, date, command and side-by-side ratios. The hand-written sections of RESULTS.md are not touched.
# bench_regression.py compares two revisions you name (--before REV), and bench_peers.py, bench_loader_levers.py and
# bench_sample_cost.py need a shard set (and peers an image folder) you name: run them by hand. The GPU checks
# (gpu_check.py, gpu_plan_check.py) need an H200.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
stamp=$(date -u +%Y%m%d-%H%M%S)
log=benchmarks/results/run_all-$stamp.log
mkdir -p benchmarks/results
{
    echo "date: $(date -u +%FT%TZ)"
    echo "machine: $(uname -srm), $(nproc) CPUs, $(free -g | awk '/Mem:/{print $2}') GiB RAM"
    echo "git: $(git rev-parse --short HEAD 2>/dev/null)"
} | tee "$log"
status=0
for bench in bench_shard bench_loader bench_train bench_layout bench_plan_memory bench_remote; do
    cmd="$PY benchmarks/$bench.py"
    echo "== $cmd" | tee -a "$log"
    start=$SECONDS
    if ! $cmd 2>&1 | tee -a "$log"; then
        echo "FAILED: $bench" | tee -a "$log"
        status=1
    fi
    echo "-- $bench: $((SECONDS - start)) s" | tee -a "$log"
done
cmd="$PY benchmarks/summarize.py"
echo "== $cmd" | tee -a "$log"
if ! $cmd 2>&1 | tee -a "$log"; then
    echo "FAILED: summarize" | tee -a "$log"
    status=1
fi
exit $status
