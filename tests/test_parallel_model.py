"""marlin.tensor_parallel on a transformers model, one process: the plan it follows and what it refuses.
(The numerics across processes are in tests/test_parallel_dist.py.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import marlin
from marlin.parallel import ColumnParallelLinear, RowParallelLinear, ShardError
from marlin.parallel.model import model_tp_plan

transformers = pytest.importorskip("transformers")


def tiny_llama(heads=4, kv_heads=2):
    config = transformers.LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=1000,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).half().eval()
    marlin.replace_linear(model, group_size=128)
    return model


def test_public_entry_points():
    # README and docs/PARALLEL.md call these by these names
    from marlin.parallel.loader import load_sharded

    assert marlin.parallel.load_sharded is load_sharded
    assert marlin.tensor_parallel is marlin.parallel.tensor_parallel
    assert issubclass(marlin.parallel.ShardError, ValueError)


def test_follows_the_models_tp_plan():
    model = tiny_llama()
    plan = model_tp_plan(model)
    if not plan:
        pytest.skip(f"transformers {transformers.__version__} gives Llama no tp_plan (LLAMA_PLAN is used then)")
    assert plan["model.layers.*.mlp.down_proj"] == "rowwise"
    report = marlin.tensor_parallel(model, rank=1, world_size=2)
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, ColumnParallelLinear) and layer.self_attn.q_proj.local.out_features == 128
    assert isinstance(layer.self_attn.k_proj, ColumnParallelLinear) and layer.self_attn.k_proj.local.out_features == 64
    assert isinstance(layer.mlp.down_proj, RowParallelLinear) and layer.mlp.down_proj.local.in_features == 256
    assert layer.mlp.down_proj.k0 == 256 and not layer.mlp.down_proj.gather_index
    assert model.lm_head.gather_output and model.lm_head.local.out_features == 500
    assert dict(report.sharded)["model.layers.0.mlp.up_proj"] == "colwise"
    if "model.embed_tokens" in plan:  # transformers >= 4.5x: "embedding_rowwise", kept replicated
        assert "model.embed_tokens" in dict(report.kept) and "kept model.embed_tokens" in str(report)


def test_explicit_plan_and_one_rank():
    model = tiny_llama()
    report = marlin.tensor_parallel(model, {"model.layers.*.mlp.up_proj": "colwise"}, rank=0, world_size=1)
    assert [name for name, _ in report.sharded] == ["model.layers.0.mlp.up_proj"]
    with pytest.raises(ValueError, match="empty plan"):
        marlin.tensor_parallel(model, {}, rank=0, world_size=1)


def test_heads_must_divide_by_the_world_size():
    model = tiny_llama(heads=4, kv_heads=2)
    with pytest.raises(ShardError, match="num_key_value_heads = 2 does not divide by world_size = 4"):
        marlin.tensor_parallel(model, rank=0, world_size=4)
    assert isinstance(model.model.layers[0].self_attn.q_proj, marlin.MarlinLinear)  # left untouched


def test_a_shard_error_leaves_the_model_untouched():
    model = tiny_llama(heads=8, kv_heads=8)  # heads divide by 8, but k_proj's 256 columns give 32 per rank
    with pytest.raises(ShardError, match=r"model\.layers\.0\.self_attn\.q_proj: out_features = 256 over 8 ranks"):
        marlin.tensor_parallel(model, rank=0, world_size=8)
    assert all(not isinstance(m, (ColumnParallelLinear, RowParallelLinear)) for m in model.modules())


def test_fused_projections_are_refused():
    fuse = pytest.importorskip("marlin.fuse")
    model = tiny_llama()
    fuse.fuse_projections(model)
    with pytest.raises(ShardError, match=r"q_proj has style 'colwise' but is a FusedPart \(fused projections"):
        marlin.tensor_parallel(model, rank=0, world_size=2)


@pytest.mark.parametrize("rank", [0, 1])
def test_shard_then_fuse_gives_each_rank_its_columns_side_by_side(rank):
    """fuse_projections after tensor_parallel: one ColumnParallelLinear per group holding this rank's
    q|k|v (gate|up) local columns; each part returns exactly what its shard returned."""
    model = tiny_llama()
    marlin.tensor_parallel(model, rank=rank, world_size=2)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    shards = {n: getattr(attn, n) for n in ("q_proj", "k_proj", "v_proj")} | {n: getattr(mlp, n) for n in ("gate_proj", "up_proj")}
    x = torch.randn(3, 256, dtype=torch.float16)
    want = {n: s(x) for n, s in shards.items()}
    report = marlin.fuse_projections(model, strict=True)
    assert [w for w, _ in report.fused] == ["model.layers.0.self_attn.qkv_proj", "model.layers.0.mlp.gate_up_proj"]
    qkv = attn.qkv_proj
    assert isinstance(qkv, ColumnParallelLinear) and not qkv.gather_output and qkv.rank == rank
    assert qkv.out_features == 256 + 2 * 128 and qkv.local.out_features == 128 + 2 * 64
    # the fused local b_q is the shards' b_q side by side (exact: no dequantization)
    assert torch.equal(qkv.local.b_q, torch.cat([shards[n].local.b_q for n in ("q_proj", "k_proj", "v_proj")], -1))
    assert torch.equal(mlp.gate_up_proj.local.b_scales,
                       torch.cat([shards[n].local.b_scales for n in ("gate_proj", "up_proj")], -1))
    for n, y in want.items():
        part = getattr(attn if n in ("q_proj", "k_proj", "v_proj") else mlp, n)
        assert type(part).__name__ == "FusedPart"
        assert torch.equal(part(x), y), n
    assert repr(attn.v_proj).endswith("qkv_proj[..., 192:256])")  # local widths 128, 64, 64


def test_gathering_or_mixed_shards_are_not_fused():
    from marlin.fuse import fuse_group

    model = tiny_llama()
    marlin.tensor_parallel(model, rank=0, world_size=2)
    attn = model.model.layers[0].self_attn
    other = tiny_llama()
    marlin.tensor_parallel(other, rank=1, world_size=2)
    with pytest.raises(ValueError, match="shards of different ranks"):
        fuse_group([attn.q_proj, attn.k_proj, other.model.layers[0].self_attn.v_proj])
    with pytest.raises(ValueError, match="not all parts are column-parallel shards"):
        fuse_group([attn.q_proj, attn.k_proj.local])
    attn.k_proj.gather_output = True
    with pytest.raises(ValueError, match=r"gathers its output"):
        fuse_group([attn.q_proj, attn.k_proj, attn.v_proj])


def test_plan_keys_relative_to_the_base_model_match():
    model = tiny_llama()
    report = marlin.tensor_parallel(model, {"layers.*.mlp.up_proj": "colwise"}, rank=0, world_size=2)
    assert [name for name, _ in report.sharded] == ["model.layers.0.mlp.up_proj"]


def test_llama_plan_when_the_model_has_none():
    from torch import nn

    from marlin.parallel.model import LLAMA_PLAN

    mlp = nn.Module()
    mlp.up_proj, mlp.down_proj = nn.Linear(128, 256), nn.Linear(256, 128)
    layer = nn.Module()
    layer.mlp = mlp
    root = nn.Module()
    root.model = nn.Module()
    root.model.layers = nn.ModuleList([layer])
    report = marlin.tensor_parallel(root, rank=1, world_size=2)
    assert dict(report.sharded) == {"model.layers.0.mlp.up_proj": "colwise", "model.layers.0.mlp.down_proj": "rowwise"}
    assert LLAMA_PLAN["model.layers.*.mlp.down_proj"] == "rowwise"


def test_head_counts_of_older_attention_modules_are_localized():
    """Attention modules that reshape with self.num_heads (older transformers) get this rank's counts."""
    from torch import nn

    attn = nn.Module()
    attn.q_proj = nn.Linear(256, 256)
    attn.num_heads, attn.num_key_value_heads, attn.hidden_size = 4, 2, 256
    root = nn.Module()
    root.attn = attn
    marlin.tensor_parallel(root, {"attn.q_proj": "colwise"}, rank=0, world_size=2)
    assert (attn.num_heads, attn.num_key_value_heads, attn.hidden_size) == (2, 1, 128)


def test_load_sharded_refuses_awq_checkpoints_clearly(tmp_path):
    # an AWQ checkpoint is not read as a GPTQ one (whose qweight is [K / 8, N], not [K, N / 8]): a
    # clear refusal that names the method and the way through marlin-convert
    transformers = pytest.importorskip("transformers")
    from awq_writer import random_awq_layer, write_awq_checkpoint

    from marlin.convert.errors import ConversionError
    from marlin.parallel import load_sharded

    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=1000)
    base = transformers.LlamaForCausalLM(config).half()
    layers = {name: random_awq_layer(m.in_features, m.out_features, 128, seed=i, bias=False)
              for i, (name, m) in enumerate(base.named_modules()) if isinstance(m, nn.Linear) and name != "lm_head"}
    others = {name: t for name, t in base.state_dict().items() if name.rpartition(".")[0] not in layers}
    write_awq_checkpoint(tmp_path, layers, others, model_config=config.to_dict())
    with pytest.raises(ConversionError, match="load_sharded: .*quant_method = 'awq': not a GPTQ checkpoint.*convert it with marlin-convert"):
        load_sharded(tmp_path, device="cpu")
