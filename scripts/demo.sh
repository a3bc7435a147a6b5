#!/usr/bin/env bash
# The demo: synthesize a small ImageNet-like folder, shard it, verify the shards, tune the loader briefly
# and run a tiny training measurement on whatever device this machine has. Outputs land in demo/.
set -euo pipefail
cd "$(dirname "$0")/.."
G=.venv/bin/gpufeed
$G synth demo/images --images 300 --classes 10 --seed 0 --overwrite
$G shard demo/images demo/shards --shard-samples 64 --multiple-of 2 --overwrite
$G verify demo/shards
$G tune demo/shards --budget 30 --batch-size 32 --image-size 64 --out demo/tuned.toml --run-dir demo/tune
# A starved verdict is exit code 1: that is a finding, not a failure of the demo.
rc=0
$G train --shards demo/shards --config demo/tuned.toml --arch resnet18 --batch-size 16 --image-size 64 \
    --measure --measure-steps 4 --run-dir demo/train || rc=$?
[ "$rc" -le 1 ] || exit "$rc"
echo "demo done: shards in demo/shards, tuned config in demo/tuned.toml, reports in demo/tune and demo/train"
