"""tests/strict_skips.py: under MARLIN_STRICT_SKIPS=1 (CI) a skip other than a missing GPU fails the run,
at collection (a module's importorskip) and in a test; GPU skips pass; without the switch nothing changes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

GPU_ONLY = '''
import pytest
@pytest.mark.skipif(True, reason="needs a CUDA GPU")
def test_gpu():
    pass
def test_cpu():
    pass
'''
MISSING_TOOL = '''
import pytest
def test_tool():
    pytest.skip("no git")
'''
MISSING_MODULE = '''
import pytest
pytest.importorskip("a_module_that_is_not_installed")
def test_x():
    pass
'''


def run_pytest(tmp_path: Path, files: dict, strict: bool) -> subprocess.CompletedProcess:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    env = dict(os.environ, PYTHONPATH=str(TESTS), MARLIN_STRICT_SKIPS="1" if strict else "0")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "strict_skips", "-p", "no:cacheprovider", str(tmp_path)]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_gpu_skips_pass(tmp_path):
    r = run_pytest(tmp_path, {"test_a.py": GPU_ONLY}, strict=True)
    assert r.returncode == 0 and "1 passed, 1 skipped" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("name,text,reason", [("test_b.py", MISSING_TOOL, "no git"),
                                              ("test_c.py", MISSING_MODULE, "a_module_that_is_not_installed")])
def test_other_skips_fail_on_ci(tmp_path, name, text, reason):
    r = run_pytest(tmp_path, {"test_a.py": GPU_ONLY, name: text}, strict=True)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "skips not allowed on CI" in r.stdout and f"{name}" in r.stdout and reason in r.stdout, r.stdout
    assert "test_a.py" not in r.stdout.split("skips not allowed on CI")[1], r.stdout  # the GPU skip is allowed
    r = run_pytest(tmp_path, {}, strict=False)
    assert r.returncode == 0 and "skips not allowed" not in r.stdout, r.stdout + r.stderr
