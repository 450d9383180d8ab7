"""Tensor parallelism across processes: 2 CPU processes with gloo (torch.multiprocessing.spawn),
the same code path NCCL takes on GPUs. The scenarios live in tests/tp_workers.py: each rank builds
the full model from a shared seed, shards it, and checks the sharded outputs against the full
model's (MLP layers with act-order off, aligned and straddling; a tiny Llama through
marlin.tensor_parallel and through marlin.parallel.load_sharded from a Marlin checkpoint and from a
GPTQ checkpoint (each rank converting its slices), prompt and one cached decode step, act-order on
and off)."""

from __future__ import annotations

import os
import sys
import time
import warnings

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

import tp_workers

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
)
JOIN_TIMEOUT_S = 600  # a whole scenario; each collective times out after tp_workers.TIMEOUT
WORLD = 2  # each spawn costs a few seconds of start-up (torch, transformers): few spawns, many checks each


def spawn(tmp_path, scenario: str, arg) -> None:
    """Runs the scenario on WORLD ranks; a rank's exception or signal fails the test (spawn raises it
    with the rank's traceback), and so do ranks still running after JOIN_TIMEOUT_S. The one signal
    that does not: every rank wrote its passed marker (tp_workers.run, after all its checks and
    before the final barrier) and a rank died by a signal after that, i.e. in gloo's teardown,
    which the product does not use (marlin.parallel runs on NCCL); the test warns instead."""
    init_file = tmp_path / "pg-init"  # FileStore rendezvous, private to this test (tp_workers.run)
    ctx = mp.start_processes(
        tp_workers.run, args=(WORLD, str(init_file), scenario, arg), nprocs=WORLD, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while True:
        try:
            if ctx.join(timeout=1.0):
                return
        except mp.ProcessExitedException as exc:
            passed = all(os.path.exists(tp_workers.passed_marker(str(init_file), r)) for r in range(WORLD))
            if exc.signal_name is None or not passed:
                raise
            warnings.warn(f"{scenario}: every rank passed its checks; rank {exc.error_index} then died "
                          f"with {exc.signal_name} while leaving gloo (not a failure of the code under test)")
            return
        if time.monotonic() > deadline:
            alive = [rank for rank, p in enumerate(ctx.processes) if p.is_alive()]
            for p in ctx.processes:
                p.kill()
                p.join()
            pytest.fail(f"{scenario}: ranks {alive} still running after {JOIN_TIMEOUT_S} s (killed)")


def test_layers_two_ranks(tmp_path):
    """Column- and row-parallel MLPs, group 128 and per column, act-order off / aligned / straddling."""
    spawn(tmp_path, "all_layers", None)


def test_models_two_ranks(tmp_path):
    """Tiny Llama via tensor_parallel, load_sharded of a Marlin and of a GPTQ checkpoint; act-order off and on; a rotated one; a fused one."""
    pytest.importorskip("transformers")
    spawn(tmp_path, "all_models", str(tmp_path / "ckpts"))


def test_sparse_model_two_ranks(tmp_path):
    """A tiny Llama with 2:4-sparse layers (zero points, groups of 64): tensor_parallel and load_sharded."""
    pytest.importorskip("transformers")
    spawn(tmp_path, "sparse", str(tmp_path / "sparse-ckpt"))


def test_compiled_decode_of_a_sharded_model_two_ranks(tmp_path):
    """compile_for_decode after tensor_parallel: one graph per step with its collectives, same tokens."""
    pytest.importorskip("transformers")
    spawn(tmp_path, "compiled_decode", None)


def test_transformers_tp_plan_is_refused_two_ranks(tmp_path):
    """from_pretrained(tp_plan="auto") of a Marlin checkpoint: a clear ValueError on every rank."""
    pytest.importorskip("transformers")
    spawn(tmp_path, "hf_tp_plan", str(tmp_path / "ckpt"))


def test_bench_tp_times_the_collectives_alone_two_ranks(tmp_path):
    """bench_tp's collectives-alone figure: the step's all-reduces and all-gather, slowest rank."""
    spawn(tmp_path, "bench_collectives", None)


def test_a_failing_rank_fails_the_test_at_once(tmp_path):
    """A rank's exception reaches the parent with its message while its peer hangs."""
    start = time.monotonic()
    with pytest.raises(mp.ProcessRaisedException, match="rank 1 fails on purpose"):
        spawn(tmp_path, "failing", 1)
    assert time.monotonic() - start < 120  # not the peer's 300 s


def test_a_rank_aborting_during_its_checks_fails_the_test(tmp_path):
    """A signal before a rank's checks passed fails the test (only a teardown abort is tolerated)."""
    with pytest.raises(mp.ProcessExitedException, match="SIGABRT"):
        spawn(tmp_path, "aborting", 1)
    assert not os.path.exists(tp_workers.passed_marker(str(tmp_path / "pg-init"), 1))


def test_hung_ranks_are_killed_at_the_deadline(tmp_path, monkeypatch):
    """Ranks still running at the deadline are killed and the test fails, naming them."""
    monkeypatch.setattr(sys.modules[__name__], "JOIN_TIMEOUT_S", 3)
    with pytest.raises(pytest.fail.Exception, match=r"ranks \[0, 1\] still running after 3 s"):
        spawn(tmp_path, "failing", None)
