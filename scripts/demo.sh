#!/usr/bin/env bash
# The README's demo command: set up (idempotent), then quantize a layer, run it, report error
# and (on a GPU) speed against FP16.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the extension is built in place
exec "${PYTHON:-python3}" scripts/demo.py "$@"
