#!/usr/bin/env bash
# Idempotent set-up used by the README's commands: makes sure torch, the runtime and test
# dependencies and the compiled extension (marlin/_C*.so, built in place) are there.
#  - CPU machine: installs torch==2.13.0 (CPU build) and what else is missing from PyPI.
#  - GPU machine (torch with CUDA preinstalled, no network): installs nothing, builds the CUDA
#    kernels against the torch that is there.
# Rebuilds only when csrc/, setup.py or the torch version changed (ninja builds incrementally).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "setup: installing torch==2.13.0 (CPU build)"
  "$PY" -m pip install -q "torch==2.13.0"
fi

# import name -> pip name; only what is missing is installed (nothing, on the GPU machine).
# compressed-tensors (tests of its checkpoints only) is left to .ci/run and `pip install .[test]`:
# a pip attempt without network could stall the GPU machine's set-up.
missing=()
# accelerate: transformers' from_pretrained refuses any device_map without it (the integration
# tests load with device_map; compressed-tensors, which used to pull it in, no longer does).
for pair in setuptools:setuptools wheel:wheel ninja:ninja safetensors:safetensors tqdm:tqdm pytest:pytest \
            numpy:numpy matplotlib:matplotlib transformers:transformers accelerate:accelerate ${MARLIN_EXTRA_DEPS:-}; do
  mod=${pair%%:*}; pkg=${pair#*:}
  "$PY" -c "import $mod" 2>/dev/null || missing+=("$pkg")
done
# pyproject.toml's license is an SPDX string (PEP 639), which setuptools reads from 77 on; the
# setuptools that Python 3.11 venvs bundle (65) would refuse the project.
if "$PY" -c "import setuptools" 2>/dev/null &&
   ! "$PY" -c "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 77)"; then
  missing+=("setuptools>=77")
fi
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  # a short timeout and one retry: without network (the GPU machine) this fails in seconds, not minutes
  "$PY" -m pip install -q --timeout 10 --retries 1 "${missing[@]}" || {
    echo "setup: could not install ${missing[*]} (no network?); continuing without them" >&2
  }
fi

stamp=$( { "$PY" -c "import torch; print(torch.__version__, torch.version.cuda)"; \
           echo "${MARLIN_CUDA:-auto} ${TORCH_CUDA_ARCH_LIST:-default}"; \
           cat setup.py; find csrc -type f | sort | xargs cat; } | sha1sum | cut -d' ' -f1)
if [ "$(cat .build-stamp 2>/dev/null)" != "$stamp" ] || ! "$PY" -c "import marlin._C" 2>/dev/null; then
  echo "setup: building marlin._C in place (MAX_JOBS=${MAX_JOBS:-$(nproc)})"
  MAX_JOBS=${MAX_JOBS:-$(nproc)} "$PY" setup.py -q build_ext --inplace
  echo "$stamp" > .build-stamp
fi
"$PY" -c "import marlin, torch; print('setup: marlin', marlin.__version__, 'torch', torch.__version__, \
'cuda' if torch.cuda.is_available() else 'cpu')"
