"""Worker processes for tests/test_parallel_dist.py: each runs under torch.multiprocessing.spawn as
one rank of a gloo process group on the CPU, builds the same full model from the same seed as every
other rank, shards it, and compares the sharded result with the full one (an AssertionError in any
rank fails the test). tests/tp_torchrun.py runs the same scenarios on GPUs with NCCL (DEVICE)."""

from __future__ import annotations

import os
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

import marlin
from marlin.nn import MarlinLinear
from marlin.parallel import ColumnParallelLinear, RowParallelLinear, ShardError
from marlin.parallel.model import LLAMA_PLAN

DEVICE = torch.device("cpu")  # tests/tp_torchrun.py sets each rank's GPU
TOL = 3e-3  # one layer: partial outputs rounded to fp16 and summed in fp16 (see test_parallel_shard)
MODEL_TOL = 1e-2  # logits after two decoder layers of fp16 activations
# rendezvous and every collective: far above a loaded 2-core CI machine's waits (a rank writing a
# checkpoint while its peer waits: seconds), far below gloo's 30-minute default, so a rank that
# died or hung fails the test in minutes instead of stalling CI
TIMEOUT = timedelta(minutes=5)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return float((x - ref).norm() / ref.norm())


def run(rank: int, world_size: int, init_file: str, scenario: str, arg) -> None:
    # rendezvous through a file in the test's own temporary directory: no port to choose, so tests
    # and CI jobs running at the same time on one machine cannot meet each other's ranks
    store = dist.FileStore(init_file, world_size)
    store.set_timeout(TIMEOUT)
    # gloo over loopback: both ranks are on this machine, and the host name need not resolve to an
    # address the ranks can reach
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=TIMEOUT)
    try:
        SCENARIOS[scenario](rank, world_size, arg)
    except BaseException:
        # the rank's own traceback (spawn re-raises it in the parent too); the group is left to
        # process exit: tearing it down while the peer waits in a collective can block or abort
        traceback.print_exc()
        raise
    # this rank's checks all passed: say so outside gloo (a file beside the rendezvous), so that
    # the parent can tell a teardown abort from a failed check (tests/test_parallel_dist.spawn)
    with open(passed_marker(init_file, rank), "w") as f:
        f.write("passed\n")
    # both ranks finish their collectives before either leaves: a rank that tore its group down
    # (or exited) while the peer's last send was in flight aborted the peer ("terminate called
    # without an active exception", SIGABRT), which a loaded CI machine hit even after a barrier
    # and a meeting through the file store; so the ranks meet through the file store once every
    # rank is past the barrier, and then leave without tearing gloo down at all: os._exit skips
    # the group's destructors and the interpreter's teardown, where the abort came from
    dist.barrier()
    store.set(f"exit-{rank}", "1")
    store.wait([f"exit-{r}" for r in range(world_size)])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def passed_marker(init_file: str, rank: int) -> str:
    """The file a rank writes once all its checks passed, next to the rendezvous file."""
    return f"{init_file}.passed-{rank}"


def marlin_from_seed(k: int, n: int, seed: int, group_size: int = 128, bias: bool = True) -> MarlinLinear:
    torch.manual_seed(seed)
    return MarlinLinear.from_linear(nn.Linear(k, n, bias=bias).half(), group_size=group_size).to(DEVICE)


def straddling_perm(k: int, seed: int) -> torch.Tensor:
    return torch.randperm(k, generator=torch.Generator().manual_seed(seed)).to(torch.int32)


def aligned_perm(k: int, world_size: int, group_size: int, seed: int) -> torch.Tensor:
    """Every group's rows inside one rank's slice; stored groups of the ranks interleaved."""
    gen = torch.Generator().manual_seed(seed)
    part = k // world_size
    blocks = [b for r in range(world_size) for b in (r * part + torch.randperm(part, generator=gen)).reshape(-1, group_size)]
    order = torch.randperm(len(blocks), generator=gen).tolist()
    return torch.cat([blocks[i] for i in order]).to(torch.int32)


def set_perm(layer: MarlinLinear, perm: torch.Tensor) -> None:
    layer.perm = perm.to(layer.b_q.device)  # 'perm' is a registered (None) buffer: makes the layer act-order


def layers_scenario(rank: int, world_size: int, group_size: int) -> None:
    """An MLP (column-parallel up, row-parallel down) with act-order off, aligned and straddling,
    and a column-parallel layer with its output gathered."""
    k, hidden = 512, 1024
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(1)).half().to(DEVICE)
    up = marlin_from_seed(k, hidden, seed=2, group_size=group_size)
    set_perm(up, straddling_perm(k, seed=3))  # column-parallel: perm on the whole K
    col = ColumnParallelLinear.from_layer(up, "up")
    full = ColumnParallelLinear.from_layer(up, "up", gather_output=True)
    assert rel_err(full(x), up(x)) < TOL, "column-parallel, gathered output"
    h_full, h_local = torch.relu(up(x)), torch.relu(col(x))
    assert h_local.shape[-1] == hidden // world_size
    perms = {"none": None, "straddling": straddling_perm(hidden, seed=4)}
    if group_size != -1:
        perms["aligned"] = aligned_perm(hidden, world_size, group_size, seed=5)
    for what, perm in perms.items():
        down = marlin_from_seed(hidden, k, seed=6, group_size=group_size)
        if perm is not None:
            set_perm(down, perm)
        row = RowParallelLinear.from_layer(down, f"down[{what}]")
        expect_gather = what == "straddling" and world_size > 1
        assert (row.gather_index is not None) == expect_gather, what
        err = rel_err(row(h_local), down(h_full))
        assert err < TOL, f"row-parallel, act-order {what}: rel err {err:.2e}"
        split = RowParallelLinear.from_layer(down, f"down[{what}]", input_is_parallel=False)
        assert rel_err(split(h_full), down(h_full)) < TOL, f"row-parallel on the full input, act-order {what}"


def tiny_llama(world_size: int, act_order: bool, dtype: torch.dtype = torch.float16, rotate: bool = False):
    """The same random tiny Llama with Marlin layers on every rank (seeded), in ``dtype``; with
    act-order, o_proj of layer 0 gets an aligned permutation and every other layer a straddling one;
    with ``rotate``, rotated first as marlin-quantize --rotate does (down_proj keeps an input_rotation)."""
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention: k/v_proj 128 wide, 64 per rank
        vocab_size=1000,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(dtype).eval()
    if rotate:
        from marlin.quantize.rotate import rotate_model

        rotate_model(model)
    marlin.replace_linear(model, group_size=128)
    model.to(DEVICE)
    if act_order:
        for i, (name, layer) in enumerate(m for m in model.named_modules() if isinstance(m[1], MarlinLinear)):
            # o_proj of layer 0 aligned, every other layer straddling
            aligned = name == "model.layers.0.self_attn.o_proj"
            k = layer.in_features
            set_perm(layer, aligned_perm(k, world_size, 128, seed=i) if aligned else straddling_perm(k, seed=i))
    return model


def prompt_and_step(model):
    """Logits of a prompt and of one cached decode step after it."""
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (2, 9), generator=torch.Generator().manual_seed(7))
    nxt = torch.randint(0, vocab, (2, 1), generator=torch.Generator().manual_seed(8))
    ids, nxt = ids.to(DEVICE), nxt.to(DEVICE)
    with torch.no_grad():
        out = model(ids, use_cache=True)
        step = model(nxt, past_key_values=out.past_key_values, use_cache=True)
    return out.logits, step.logits


def llama_scenario(rank: int, world_size: int, act_order: bool) -> None:
    """A tiny Llama: logits of a prompt and of one cached decode step, sharded vs unsharded."""
    model = tiny_llama(world_size, act_order)
    config = model.config
    ref_prompt, ref_step = prompt_and_step(model)
    report = marlin.tensor_parallel(model, LLAMA_PLAN)
    assert len(report.sharded) == 7 * config.num_hidden_layers + 1, report  # + lm_head (fp16, gathered)
    o_proj = model.model.layers[0].self_attn.o_proj
    assert isinstance(o_proj, RowParallelLinear) and o_proj.local.in_features == 256 // world_size
    if act_order and world_size > 1:
        assert o_proj.gather_index is None and o_proj.local.perm is not None
        assert model.model.layers[1].mlp.down_proj.gather_index is not None
    prompt, step = prompt_and_step(model)
    err_prompt, err_step = rel_err(prompt, ref_prompt), rel_err(step, ref_step)
    assert err_prompt < MODEL_TOL and err_step < MODEL_TOL, (err_prompt, err_step)
    # shard, then fuse: each rank's q|k|v and gate|up shards in one GEMM, the same logits
    fused = marlin.fuse_projections(model)
    if act_order:  # every layer here has its own permutation: nothing shares a GEMM, nothing changes
        assert not fused.fused and all("permutations" in why for _, why in fused.skipped), fused
    else:
        assert len(fused.fused) == 2 * config.num_hidden_layers and not fused.skipped, fused
        assert isinstance(model.model.layers[0].self_attn.qkv_proj, ColumnParallelLinear)
    f_prompt, f_step = prompt_and_step(model)
    err = (rel_err(f_prompt, ref_prompt), rel_err(f_step, ref_step), rel_err(f_prompt, prompt), rel_err(f_step, step))
    assert max(err) < MODEL_TOL, err


def save_marlin_checkpoint(model, directory) -> None:
    """A Marlin checkpoint directory (config.json with the Marlin quantization config, safetensors)."""
    import json
    from pathlib import Path

    from marlin.convert.checkpoint import write_shard

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "marlin", "checkpoint_format": "marlin", "bits": 4, "group_size": 128}
    (directory / "config.json").write_text(json.dumps(config))
    write_shard(directory / "model.safetensors", dict(model.state_dict()))


def load_scenario(rank: int, world_size: int, arg) -> None:
    """load_sharded reads each rank's slices of a checkpoint; logits equal the unsharded model's.
    arg: (directory, act_order[, dtype]); the model loads in the checkpoint's dtype."""
    from marlin.parallel.loader import load_sharded

    directory, act_order = arg[:2]
    dtype = arg[2] if len(arg) > 2 else torch.float16
    model = tiny_llama(world_size, act_order, dtype)
    if rank == 0:
        save_marlin_checkpoint(model, directory)
    dist.barrier()
    ref_prompt, ref_step = prompt_and_step(model)
    sharded = load_sharded(directory, device=DEVICE, plan=LLAMA_PLAN)
    assert sharded.dtype == dtype and sharded.model.layers[0].mlp.up_proj.local.dtype == dtype
    up = sharded.model.layers[0].mlp.up_proj
    assert isinstance(up, ColumnParallelLinear) and tuple(up.local.b_q.shape) == (256 // 16, 2 * 512 // world_size)
    full_up = model.model.layers[0].mlp.up_proj
    part = 2 * 512 // world_size
    assert torch.equal(up.local.b_q, full_up.b_q[:, rank * part : (rank + 1) * part])
    down = sharded.model.layers[1].mlp.down_proj
    assert isinstance(down, RowParallelLinear) and (down.gather_index is not None) == (act_order and world_size > 1)
    assert isinstance(sharded.lm_head, ColumnParallelLinear) and sharded.lm_head.local.out_features == 1000 // world_size
    assert len(sharded.tp_report.sharded) == 15, sharded.tp_report
    prompt, step = prompt_and_step(sharded)
    err_prompt, err_step = rel_err(prompt, ref_prompt), rel_err(step, ref_step)
    tol = MODEL_TOL if dtype == torch.float16 else 4 * MODEL_TOL  # bf16: 3 fewer mantissa bits, same sums
    assert err_prompt < tol and err_step < tol, (err_prompt, err_step)


def load_fused_scenario(rank: int, world_size: int, directory: str) -> None:
    """A checkpoint saved after fuse_projections (qkv_proj, gate_up_proj) loads sharded: each rank
    reads each part's own column slice from the fused tensors; logits equal the unsharded model's.
    A plan that splits a fused part any other way is refused."""
    from marlin.parallel.loader import load_sharded

    model = tiny_llama(world_size, False)
    ref_prompt, ref_step = prompt_and_step(model)
    attn = model.model.layers[0].self_attn
    parts = [attn.q_proj.b_q.clone(), attn.k_proj.b_q.clone(), attn.v_proj.b_q.clone()]
    marlin.fuse_projections(model, strict=True)
    if rank == 0:
        save_marlin_checkpoint(model, directory)
    dist.barrier()
    sharded = load_sharded(directory, device=DEVICE, plan=LLAMA_PLAN)
    qkv = sharded.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, ColumnParallelLinear) and qkv.local.out_features == (256 + 2 * 128) // world_size
    # rank r holds q's r-th slice, then k's, then v's (2 words per 4-bit column)
    want = torch.cat([b[:, rank * b.shape[1] // world_size : (rank + 1) * b.shape[1] // world_size] for b in parts], -1)
    assert torch.equal(qkv.local.b_q, want)
    assert len(sharded.tp_report.sharded) == 15, sharded.tp_report
    prompt, step = prompt_and_step(sharded)
    err_prompt, err_step = rel_err(prompt, ref_prompt), rel_err(step, ref_step)
    assert err_prompt < MODEL_TOL and err_step < MODEL_TOL, (err_prompt, err_step)
    try:
        load_sharded(directory, device=DEVICE, plan={**LLAMA_PLAN, "model.layers.*.self_attn.k_proj": "rowwise"})
    except ShardError as e:
        assert "qkv_proj" in str(e) and "colwise" in str(e), e
    else:
        raise AssertionError("a fused part planned row-parallel was not refused")


def write_tiny_gptq(directory, act_order: bool, bits: int = 4, sym: bool = True, group_size: int = 128) -> None:
    """A tiny Llama GPTQ checkpoint (gptq_writer), two shards with an index, bias-free projections;
    4- or 8-bit, symmetric or (4 bits) with zero points, in groups of ``group_size``."""
    import transformers
    from gptq_writer import random_layer, write_gptq_checkpoint

    config = transformers.LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=1000, max_position_embeddings=256,
    )
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(config).half()
    layers, others, seed = {}, {}, 0
    for name, module in base.named_modules():
        if isinstance(module, nn.Linear) and name != "lm_head":
            seed += 1
            layers[name] = random_layer(module.in_features, module.out_features, group_size, seed=seed, act_order=act_order,
                                        bias=False, bits=bits, sym=sym)
    for name, t in base.state_dict().items():
        if name.rpartition(".")[0] not in layers:
            others[name] = t
    write_gptq_checkpoint(
        directory, layers, others, desc_act=act_order, num_shards=2, model_config=config.to_dict(), bits=bits, sym=sym,
        group_size=group_size,
    )


def load_gptq_scenario(rank: int, world_size: int, arg) -> None:
    """load_sharded of a GPTQ checkpoint (each rank converts its slices) equals the unsharded model
    converted by marlin-convert and loaded by load_quantized. arg: (directory, act_order[, bits, sym,
    group_size])."""
    from pathlib import Path

    from marlin.convert import convert_gptq_checkpoint
    from marlin.parallel.loader import load_sharded

    directory, act_order = Path(arg[0]), arg[1]
    bits, sym, group_size = arg[2:] if len(arg) > 2 else (4, True, 128)
    if rank == 0:
        write_tiny_gptq(directory / "gptq", act_order, bits, sym, group_size)
        convert_gptq_checkpoint(directory / "gptq", directory / "marlin")
    dist.barrier()
    full = marlin.load_quantized(directory / "marlin", device=DEVICE)
    ref_prompt, ref_step = prompt_and_step(full)
    sharded = load_sharded(directory / "gptq", device=DEVICE, plan=LLAMA_PLAN)
    down = sharded.model.layers[0].mlp.down_proj
    assert isinstance(down, RowParallelLinear) and (down.gather_index is not None) == (act_order and world_size > 1)
    up, full_up = sharded.model.layers[0].mlp.up_proj, full.model.layers[0].mlp.up_proj
    assert (up.local.bits, up.local.b_zeros is not None) == (bits, not sym) == (full_up.bits, full_up.b_zeros is not None)
    part = bits // 2 * 512 // world_size  # int32 words per column: 2 (4 bits) or 4 (8 bits)
    assert torch.equal(up.local.b_q, full_up.b_q[:, rank * part : (rank + 1) * part])
    if not sym:  # zero points shard like the scales: columns of 64
        cols = slice(rank * 512 // world_size, (rank + 1) * 512 // world_size)
        assert torch.equal(up.local.b_zeros, full_up.b_zeros[:, cols]) and torch.equal(up.local.b_scales, full_up.b_scales[:, cols])
    if not act_order:  # a plain row slice, converted by this rank alone
        k_part = 512 // world_size
        assert torch.equal(down.local.b_q, full.model.layers[0].mlp.down_proj.b_q[rank * k_part // 16 : (rank + 1) * k_part // 16])
    prompt, step = prompt_and_step(sharded)
    err_prompt, err_step = rel_err(prompt, ref_prompt), rel_err(step, ref_step)
    assert err_prompt < MODEL_TOL and err_step < MODEL_TOL, (err_prompt, err_step)


def all_layers_scenario(rank: int, world_size: int, arg) -> None:
    for group_size in (128, -1):
        layers_scenario(rank, world_size, group_size)


def all_models_scenario(rank: int, world_size: int, directory: str) -> None:
    """Every model scenario, act-order off and on, in one process group (one spawn: start-up is the cost)."""
    from pathlib import Path

    for act_order in (False, True):
        llama_scenario(rank, world_size, act_order)
        load_scenario(rank, world_size, (str(Path(directory) / f"marlin-{act_order}"), act_order))
        load_gptq_scenario(rank, world_size, (str(Path(directory) / f"gptq-{act_order}"), act_order))
    # a bf16 Marlin checkpoint loads in bf16
    load_scenario(rank, world_size, (str(Path(directory) / "marlin-bf16"), False, torch.bfloat16))
    # the other GPTQ formats load_sharded converts per rank: zero points in groups of 64, 8 bits with act-order
    load_gptq_scenario(rank, world_size, (str(Path(directory) / "gptq-zp"), False, 4, False, 64))
    load_gptq_scenario(rank, world_size, (str(Path(directory) / "gptq-u8"), True, 8, True, 128))
    rotated_scenario(rank, world_size, str(Path(directory) / "marlin-rotated"))
    load_fused_scenario(rank, world_size, str(Path(directory) / "marlin-fused"))


def rotated_scenario(rank: int, world_size: int, directory: str) -> None:
    """A rotated tiny Llama (marlin-quantize --rotate's layers: down_proj rotates its input online):
    tensor_parallel of the model and load_sharded of its checkpoint give the unsharded logits.
    Without act-order each row shard of down_proj rotates its own slice of whole 64-input blocks;
    with (straddling groups) the RowParallelLinear rotates the gathered full input."""
    from pathlib import Path

    from marlin.parallel.loader import load_sharded

    for act_order in (False, True):
        model = tiny_llama(world_size, act_order, rotate=True)
        want = model.model.layers[1].mlp.down_proj.input_rotation
        assert want is not None
        ref_prompt, ref_step = prompt_and_step(model)
        where = Path(directory) / f"act-order-{act_order}"
        if rank == 0:
            save_marlin_checkpoint(model, where)
        dist.barrier()
        for what in ("load_sharded", "tensor_parallel"):
            if what == "load_sharded":
                m = load_sharded(where, device=DEVICE, plan=LLAMA_PLAN)
            else:
                m = tiny_llama(world_size, act_order, rotate=True)
                marlin.tensor_parallel(m, LLAMA_PLAN)
            down = m.model.layers[1].mlp.down_proj
            gathers = act_order and world_size > 1
            assert isinstance(down, RowParallelLinear) and (down.gather_index is not None) == gathers, what
            holder = down if gathers else down.local  # who rotates: the wrapper (gathered input) or the shard
            other = down.local if gathers else down
            assert torch.equal(holder.input_rotation.to(want.device), want) and other.input_rotation is None, what
            prompt, step = prompt_and_step(m)
            err_prompt, err_step = rel_err(prompt, ref_prompt), rel_err(step, ref_step)
            assert err_prompt < MODEL_TOL and err_step < MODEL_TOL, (what, act_order, err_prompt, err_step)



def sparse_scenario(rank: int, world_size: int, directory: str) -> None:
    """A tiny Llama with 2:4-sparse layers (zero points, groups of 64): tensor_parallel of the model
    and load_sharded of its checkpoint give the unsharded model's logits (k/v_proj: 64 columns
    per rank, the 2:4 kernel's 64-column tile on a GPU)."""
    import transformers

    from marlin.parallel.loader import load_sharded
    from marlin.sparse_nn import MarlinLinear24

    def build():
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(tiny_llama(1, False).config).half().eval()
        marlin.replace_linear(model, group_size=64, sym=False, sparsity="2:4")
        return model.to(DEVICE)

    model = build()
    assert sum(isinstance(m, MarlinLinear24) for m in model.modules()) == 7 * model.config.num_hidden_layers
    ref_prompt, ref_step = prompt_and_step(model)
    if rank == 0:
        save_marlin_checkpoint(model, directory)
    dist.barrier()
    sharded = load_sharded(directory, device=DEVICE, plan=LLAMA_PLAN)
    k_proj = sharded.model.layers[0].self_attn.k_proj
    assert isinstance(k_proj, ColumnParallelLinear) and isinstance(k_proj.local, MarlinLinear24)
    assert k_proj.local.zero_points and k_proj.local.out_features == 128 // world_size
    assert torch.equal(k_proj.local.b_meta, model.model.layers[0].self_attn.k_proj.b_meta[:, rank * 64 : (rank + 1) * 64])
    for what, m in (("load_sharded", sharded), ("tensor_parallel", None)):
        if m is None:
            m = build()
            marlin.tensor_parallel(m, LLAMA_PLAN)
            down = m.model.layers[1].mlp.down_proj
            assert isinstance(down, RowParallelLinear) and down.local.in_features == 512 // world_size
        prompt, step = prompt_and_step(m)
        err_prompt, err_step = rel_err(prompt, ref_prompt), rel_err(step, ref_step)
        assert err_prompt < MODEL_TOL and err_step < MODEL_TOL, (what, err_prompt, err_step)
    # the loaded shards fused per rank (2:4 q|k|v and gate|up: values, metadata, scales, zero points)
    report = marlin.fuse_projections(sharded, strict=True)
    assert len(report.fused) == 2 * sharded.config.num_hidden_layers
    assert isinstance(sharded.model.layers[0].self_attn.qkv_proj.local, MarlinLinear24)
    prompt, step = prompt_and_step(sharded)
    err_prompt, err_step = rel_err(prompt, ref_prompt), rel_err(step, ref_step)
    assert err_prompt < MODEL_TOL and err_step < MODEL_TOL, ("load_sharded + fuse", err_prompt, err_step)


def compiled_decode_scenario(rank: int, world_size: int, arg) -> None:
    """marlin.compile_for_decode on a sharded model: the decode step (with its all-reduces and the
    lm_head all-gather) compiles as one graph (fullgraph=True) and generate() gives the unsharded
    model's greedy tokens. arg: torch.compile mode ("reduce-overhead" on GPUs; None on the CPU,
    which has no CUDA graphs)."""
    from torch._dynamo.utils import counters

    model = tiny_llama(world_size, False)
    ids = torch.randint(0, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    marlin.tensor_parallel(model, LLAMA_PLAN)
    marlin.compile_for_decode(model, mode=arg, compile_on_cpu=DEVICE.type == "cpu")
    assert len(model.marlin_decode.fused.fused) == 2 * model.config.num_hidden_layers
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert counters["stats"]["unique_graphs"] >= 1, dict(counters["stats"])  # the step did compile
    assert torch.equal(out, ref), (out, ref)


def hf_tp_plan_scenario(rank: int, world_size: int, directory: str) -> None:
    """transformers' own tensor parallelism (from_pretrained(..., tp_plan="auto"), or its
    distributed_config where transformers has one) on a Marlin checkpoint: refused on every rank
    with a ValueError that names marlin.parallel.load_sharded,
    instead of the op failing on DTensor inputs at the first forward."""
    import transformers

    model = tiny_llama(world_size, False)
    if rank == 0:
        save_marlin_checkpoint(model, directory)
    dist.barrier()
    # transformers takes its tensor-parallel layout from torchrun's variables (spawn sets none)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    # the argument as it was, and as transformers asks for it from 5.18 on (distributed_config)
    spellings = {"tp_plan='auto'": {"tp_plan": "auto"}}
    if hasattr(transformers, "DistributedConfig"):
        spellings["distributed_config"] = {"distributed_config": transformers.DistributedConfig(tp_plan="auto")}
    for name, kwargs in spellings.items():
        try:
            transformers.AutoModelForCausalLM.from_pretrained(directory, **kwargs)
        except ValueError as e:
            assert "marlin.parallel.load_sharded" in str(e), (name, e)
        else:
            raise AssertionError(f"from_pretrained({name}) of a Marlin checkpoint was not refused")


def bench_collectives_scenario(rank: int, world_size: int, arg) -> None:
    """benchmarks/bench_tp.collectives_alone_us: a step's all-reduces and all-gather on their own, the
    slowest rank's time (the same figure on every rank)."""
    from types import SimpleNamespace

    from benchmarks import bench_tp

    model = SimpleNamespace(shape=bench_tp.TINY)
    us = bench_tp.collectives_alone_us(model, SimpleNamespace(steps=4, repeats=3), 2, world_size, DEVICE)
    assert us > 0, us
    both = [None] * world_size
    dist.all_gather_object(both, us)
    assert both == [us] * world_size, both


def failing_scenario(rank: int, world_size: int, arg) -> None:
    """Rank `arg` fails at once and every other rank hangs (tests/test_parallel_dist.py checks that the
    failure reaches the parent at once, with its message); arg None: every rank hangs."""
    if rank == arg:
        raise AssertionError(f"rank {rank} fails on purpose")
    time.sleep(300)  # (not a collective: a peer's lost connection would race the failure to the parent)


def aborting_scenario(rank: int, world_size: int, arg) -> None:
    """Rank `arg` dies by SIGABRT before its checks pass (no passed marker): the test must fail, the
    parent's allowance for an abort while leaving gloo must not cover it."""
    if rank == arg:
        os.abort()
    time.sleep(300)


SCENARIOS = {
    "aborting": aborting_scenario,
    "bench_collectives": bench_collectives_scenario,
    "failing": failing_scenario,
    "layers": layers_scenario,
    "llama": llama_scenario,
    "compiled_decode": compiled_decode_scenario,
    "hf_tp_plan": hf_tp_plan_scenario,
    "load": load_scenario,
    "load_gptq": load_gptq_scenario,
    "load_fused": load_fused_scenario,
    "rotated": rotated_scenario,
    "all_layers": all_layers_scenario,
    "all_models": all_models_scenario,
    "sparse": sparse_scenario,
}
