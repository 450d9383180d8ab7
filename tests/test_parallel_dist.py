"""Tensor parallelism across processes: 2 CPU processes with gloo (torch.multiprocessing.spawn),
the same code path NCCL takes on GPUs. The scenarios live in tests/tp_workers.py: each rank builds
the full model from a shared seed, shards it, and checks the sharded outputs against the full
model's (MLP layers with act-order off, aligned and straddling; a tiny Llama through
marlin.tensor_parallel and through marlin.parallel.load_sharded from a Marlin checkpoint and from a
GPTQ checkpoint (each rank converting its slices), prompt and one cached decode step, act-order on
and off)."""

from __future__ import annotations

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

import tp_workers

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
)
WORLD = 2  # each spawn costs a few seconds of start-up (torch, transformers): few spawns, many checks each


def spawn(tmp_path, scenario: str, arg) -> None:
    init_file = tmp_path / "pg-init"
    mp.spawn(tp_workers.run, args=(WORLD, str(init_file), scenario, arg), nprocs=WORLD, join=True)


def test_layers_two_ranks(tmp_path):
    """Column- and row-parallel MLPs, group 128 and per column, act-order off / aligned / straddling."""
    spawn(tmp_path, "all_layers", None)


def test_models_two_ranks(tmp_path):
    """Tiny Llama via tensor_parallel, load_sharded of a Marlin and of a GPTQ checkpoint; act-order off and on."""
    pytest.importorskip("transformers")
    spawn(tmp_path, "all_models", str(tmp_path / "ckpts"))
