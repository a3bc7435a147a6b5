#!/usr/bin/env bash
# The demo: synthesize a small ImageNet-like folder, shard it, verify the shards.
set -euo pipefail
cd "$(dirname "$0")/.."
G=.venv/bin/gpufeed
$G synth demo/images --images 300 --classes 10 --seed 0
$G shard demo/images demo/shards --shard-samples 64 --multiple-of 2 --overwrite
$G verify demo/shards
