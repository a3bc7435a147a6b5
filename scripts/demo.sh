#!/usr/bin/env bash
# The demo is one config now: gpufeed run configs/demo.toml (outputs in runs/demo/, report in runs/demo/report.html).
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/gpufeed run configs/demo.toml "$@"
