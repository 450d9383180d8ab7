#!/usr/bin/env bash
# The README's test command: set up (idempotent), then run the whole test suite. GPU tests run
# when a GPU is visible and are skipped otherwise. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the extension is built in place
exec "${PYTHON:-python3}" -m pytest tests -q -ra "$@"
