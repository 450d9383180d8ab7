"""pytest plugin (its hooks are imported by tests/conftest.py): with MARLIN_STRICT_SKIPS=1, as .ci/run
sets it, a test skipped for any reason other than a missing GPU fails the run.

CI has no GPU, and every test that can run on a CPU must run there. A skip for a missing package, a
missing tool or a library version would otherwise pass quietly and change only the skipped count, so
the count could not tell a new GPU test from a lost CPU test. Under this switch it is exactly the
number of GPU-only tests.
"""

from __future__ import annotations

import os

import pytest

# the reasons of the GPU marks (tests/conftest.py requires_cuda and requires_cuda_2_4, the test files'
# cuda_only): the only skips allowed on a machine without a GPU
GPU_SKIP_PREFIX = "needs a CUDA GPU"
_unexpected: list[tuple[str, str]] = []


def _strict() -> bool:
    return os.environ.get("MARLIN_STRICT_SKIPS") == "1"


def _note(report) -> None:
    if not (_strict() and report.skipped) or hasattr(report, "wasxfail"):
        return
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    reason = reason.removeprefix("Skipped: ")
    if not reason.startswith(GPU_SKIP_PREFIX):
        _unexpected.append((report.nodeid, reason))


def pytest_runtest_logreport(report) -> None:
    _note(report)


def pytest_collectreport(report) -> None:  # a whole module skipped (pytest.importorskip at import)
    _note(report)


def pytest_sessionfinish(session, exitstatus) -> None:
    if _unexpected and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter) -> None:
    if not _unexpected:
        return
    terminalreporter.section("skips not allowed on CI (MARLIN_STRICT_SKIPS=1)", red=True)
    for nodeid, reason in _unexpected:
        terminalreporter.write_line(f"{nodeid}: {reason} (only '{GPU_SKIP_PREFIX}...' may skip)")
