"""torch.ops.marlin.gemm without a workspace: each (device, stream) uses its own zeroed lock slot
(csrc/cuda/stream_locks.cu), so direct calls need no allocation or memset. Checked in a fresh
process (tests/gpu_direct_calls.py): the process's first call under CUDA-graph capture, two
streams at once, a second device where there is one."""

import os
import subprocess
import sys

import pytest

from conftest import requires_cuda

pytestmark = [requires_cuda, pytest.mark.gpu]


def test_direct_calls_in_graphs_streams_and_devices():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # MARLIN_SMALL_LAYER_CLUSTERS=0: on H100/H200 this small layer would otherwise run the
    # small-batch kernel with its column reduced in one cluster, which uses no lock counters
    env = dict(os.environ, MARLIN_LOG_PLAN="1", MARLIN_SMALL_LAYER_CLUSTERS="0",
               PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "tests/gpu_direct_calls.py"], cwd=root, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    # the test is about calls whose plan uses the locks: the log must show them
    assert "global_reduction=1" in r.stderr, r.stderr[-2000:]
    assert "graph replay 2: rel err" in r.stdout and "stream 1 call 39: rel err" in r.stdout, r.stdout[-2000:]
