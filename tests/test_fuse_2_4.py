"""fuse_projections on 2:4-sparse layers (MarlinLinear24), CPU op.

The 2:4 layout keeps the dense layout's 64-column tiles (values, metadata, scales and zero points
each stored per tile), so the fused layer is the parts' buffers side by side. These tests check
that against the packer, against the unfused layers bit for bit, through a whole model, and
through save_pretrained / from_pretrained / load_quantized of the fused model.
"""

from __future__ import annotations

import pytest
import torch

import marlin
from marlin import sparse
from marlin.fuse import FusedPart, fuse_group, fuse_projections
from marlin.nn import MarlinLinear
from marlin.sparse_nn import MarlinLinear24

from conftest import assert_fusing_keeps_logits, random_linear, rel_err, tiny_llama_config

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("group_size,sym", [(128, True), (64, False), (-1, True), (32, False)])
def test_concatenated_2_4_packing_is_the_packing_of_the_concatenation(group_size, sym):
    gen = torch.Generator().manual_seed(0)
    k, widths = 256, (192, 64, 128)  # 64-column widths too: whole tiles, not whole 128s
    ws = [sparse.prune_2_4(torch.randn(k, n, generator=gen)) for n in widths]
    parts = [sparse.quantize_and_pack_2_4(w, group_size, sym=sym) for w in ws]
    whole = sparse.quantize_and_pack_2_4(torch.cat(ws, dim=1), group_size, sym=sym)
    assert len(whole) == (3 if sym else 4)
    for i, t in enumerate(whole):  # b_q, b_meta, b_scales (, b_zeros)
        assert torch.equal(torch.cat([p[i] for p in parts], dim=1), t), i


def _layer(k, n, bias, seed, group_size=128, sym=True, dtype=torch.float16):
    return MarlinLinear24.from_linear(random_linear(k, n, bias, seed, dtype), group_size, sym=sym)


@pytest.mark.parametrize("sym", [True, False], ids=["sym", "zp"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_fuse_group_of_2_4_layers_computes_the_parts_side_by_side(sym, dtype):
    parts = [_layer(256, 192, True, 1, 64, sym, dtype), _layer(256, 64, False, 2, 64, sym, dtype),
             _layer(256, 128, True, 3, 64, sym, dtype)]
    fused = fuse_group(parts)
    assert type(fused) is MarlinLinear24 and fused.pruned_fraction is None
    assert (fused.in_features, fused.out_features, fused.zero_points) == (256, 384, not sym)
    assert fused.b_meta.shape == (256 // 32, 384) and fused.bias.shape == (384,)
    assert not fused.workspace.any() and all(fused.workspace is not p.workspace for p in parts)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(4)).to(dtype)
    with torch.no_grad():
        y = fused(x)
        assert torch.equal(y, torch.cat([p(x) for p in parts], dim=-1))
        # and the right answer, not only a consistent one
        w = torch.cat([p.dequantized_weight().t() for p in parts], dim=1)
        b = torch.cat([p.bias.double() if p.bias is not None else torch.zeros(p.out_features).double() for p in parts])
        ref = x.double() @ w.double() + b
        assert rel_err(y, ref) < (1e-3 if dtype == torch.float16 else 8e-3)
        # a part's columns shifted by one tile would not pass
        assert rel_err(y.roll(64, dims=-1), ref) > 0.5


def test_2_4_parts_that_cannot_share_a_gemm_are_refused():
    a = _layer(256, 128, False, 1)
    with pytest.raises(ValueError, match="not all parts are MarlinLinear, or all MarlinLinear24"):
        fuse_group([a, MarlinLinear.from_linear(random_linear(256, 128, False, 5), 128)])
    with pytest.raises(ValueError, match="b_scales"):
        fuse_group([a, _layer(256, 128, False, 2, group_size=-1)])
    with pytest.raises(ValueError, match="different buffers"):
        fuse_group([a, _layer(256, 128, False, 3, sym=False)])
    with pytest.raises(ValueError, match="different in_features"):
        fuse_group([a, _layer(384, 128, False, 4)])


def _llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(tiny_llama_config()).half().eval()


@pytest.mark.parametrize("sym", [True, False], ids=["sym", "zp"])
def test_replace_linear_2_4_with_fuse_matches_unfused(sym):
    model, ref = _llama(), _llama()
    report = marlin.replace_linear(model, sparsity="2:4", sym=sym, fuse=True)
    marlin.replace_linear(ref, sparsity="2:4", sym=sym)
    assert report.fused is not None and len(report.fused.fused) == 4 and not report.fused.skipped
    assert "fused 4 groups of projections" in str(report)
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.k_proj, FusedPart) and type(attn.qkv_proj) is MarlinLinear24
    assert len(report.pruned) == 14  # 7 projections x 2 blocks, each with its own pruning figure
    ids = torch.randint(0, 1000, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)


def test_fused_2_4_model_saves_and_loads_back(tmp_path):
    model = _llama()
    marlin.replace_linear(model, sparsity="2:4", group_size=64, fuse=True)
    model.save_pretrained(tmp_path / "saved")
    want = model.state_dict()
    assert "model.layers.0.mlp.gate_up_proj.b_meta" in want
    ids = torch.randint(0, 1000, (1, 6), generator=torch.Generator().manual_seed(2))
    logits = []
    for loaded in (marlin.load_quantized(tmp_path / "saved", device="cpu"),
                   transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved")):
        mlp = loaded.model.layers[1].mlp
        assert isinstance(mlp.up_proj, FusedPart) and type(mlp.gate_up_proj) is MarlinLinear24
        assert not mlp.gate_up_proj.workspace.is_meta and not mlp.gate_up_proj.workspace.any()
        got = loaded.state_dict()
        assert got.keys() == want.keys()
        for name in want:
            assert torch.equal(got[name], want[name]), name
        with torch.no_grad():
            logits.append(loaded(ids).logits)
    assert torch.equal(logits[0], logits[1])
    # the model built in place kept its rotary frequencies in fp16 (model.half()); a loaded one
    # computes them in fp32: the same weights, logits within fp16 rounding
    with torch.no_grad():
        assert rel_err(logits[0], model(ids).logits.double()) < 1e-2


def test_fuse_projections_on_an_unfused_2_4_model():
    model = _llama()
    marlin.replace_linear(model, sparsity="2:4")
    assert_fusing_keeps_logits(model, seq_len=5)
