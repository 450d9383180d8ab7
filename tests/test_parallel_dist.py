"""Tensor parallelism across processes: 2 CPU processes with gloo (torch.multiprocessing.spawn),
the same code path NCCL takes on GPUs. The scenarios live in tests/tp_workers.py: each rank builds
the full model from a shared seed, shards it, and checks the sharded outputs against the full
model's (MLP layers with act-order off, aligned and straddling; a tiny Llama through
marlin.tensor_parallel and through marlin.parallel.load_sharded from a checkpoint, prompt and one
cached decode step, act-order on and off)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import tp_workers

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
)
WORLD = 2


def spawn(tmp_path, scenario: str, arg) -> None:
    init_file = tmp_path / "pg-init"
    mp.spawn(tp_workers.run, args=(WORLD, str(init_file), scenario, arg), nprocs=WORLD, join=True)


@pytest.mark.parametrize("group_size", [128, -1])
def test_layers_two_ranks(tmp_path, group_size):
    spawn(tmp_path, "layers", group_size)


@pytest.mark.parametrize("act_order", [False, True])
def test_tiny_llama_two_ranks(tmp_path, act_order):
    pytest.importorskip("transformers")
    spawn(tmp_path, "llama", act_order)


@pytest.mark.parametrize("act_order", [False, True])
def test_load_sharded_two_ranks(tmp_path, act_order):
    pytest.importorskip("transformers")
    spawn(tmp_path, "load", (str(tmp_path / "ckpt"), act_order))
