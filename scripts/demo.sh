#!/usr/bin/env bash
# The demo: check the machine, synthesize a small ImageNet-like folder, shard it, verify the shards, measure what
# the storage delivers, stage a checked copy, tune the loader briefly, plan memory and cores, and run a tiny
# training measurement on whatever device this machine has. Outputs land in demo/.
set -euo pipefail
cd "$(dirname "$0")/.."
G=.venv/bin/gpufeed
# plan (too few cores for the target) and train (a starved verdict) exit 1 on a finding, not a failure of the demo.
$G doctor   # exit 1 would mean a failed check on this machine: stop and read it
$G synth demo/images --images 300 --classes 10 --seed 0 --overwrite
$G shard demo/images demo/shards --shard-samples 64 --multiple-of 2 --overwrite
$G verify demo/shards
$G io demo/shards --seconds 1 --run-dir demo/io
$G stage demo/shards demo/staged --quiet
$G tune demo/staged --budget 30 --batch-size 32 --image-size 64 --out demo/tuned.toml --run-dir demo/tune
$G plan --arch resnet18 --batch-size 16 --image-size 64 --record demo/tune/summary.json --target-rate 200 \
    || { r=$?; [ "$r" -le 1 ] || exit "$r"; }
$G train --shards demo/staged --config demo/tuned.toml --arch resnet18 --batch-size 16 --image-size 64 \
    --measure --measure-steps 4 --run-dir demo/train || { r=$?; [ "$r" -le 1 ] || exit "$r"; }
echo "demo done: shards in demo/shards (staged copy in demo/staged), tuned config in demo/tuned.toml, reports in demo/io, demo/tune and demo/train"
