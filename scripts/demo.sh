#!/usr/bin/env bash
# The demo: check the machine, synthesize a small ImageNet-like folder, shard it, verify the shards, measure what
# the storage delivers, stage a checked copy, tune the loader with the model's step beside it, run a tiny training
# measurement with --fix on whatever device this machine has, and plan memory and cores from it. Outputs land in demo/.
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
# tune with the model's training step beside the loader, at training's batch size: it measures what training gets
$G tune demo/staged --budget 90 --batch-size 16 --image-size 64 --with-model resnet18 --out demo/tuned.toml \
    --run-dir demo/tune
# --fix tries each fix the verdict can apply itself, re-measured; demo/train/fixed.toml holds what was kept
$G train --shards demo/staged --config demo/tuned.toml --arch resnet18 --batch-size 16 --image-size 64 \
    --measure --measure-steps 4 --fix --fix-budget-s 120 --run-dir demo/train || { r=$?; [ "$r" -le 1 ] || exit "$r"; }
# the loader's cores per sample from train's loader-only mode (tune's trials also hold the model's step)
$G plan --arch resnet18 --batch-size 16 --image-size 64 --record demo/train/summary.json --target-rate 200 \
    || { r=$?; [ "$r" -le 1 ] || exit "$r"; }
echo "demo done: shards in demo/shards (staged copy in demo/staged), tuned config in demo/tuned.toml, reports in demo/io, demo/tune and demo/train"
