"""marlin.fuse_projections: q/k/v and gate/up merged into one Marlin layer each, on the CPU op.

Fusion must be exact: the concatenated packed buffers equal the packer's output for the
concatenated weights (bit for bit), and a fused model computes the same logits as the unfused one
(the op computes each output column the same way whatever N is, so they are compared exactly).
"""

from __future__ import annotations

import copy

import pytest
import torch

import marlin
from marlin import packing
from marlin.fuse import FusedPart, fuse_group, fuse_projections
from marlin.nn import MarlinLinear

from conftest import assert_fusing_keeps_logits, random_linear, rel_err, tiny_llama_config

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("group_size", [128, -1])
def test_concatenated_packing_is_the_packing_of_the_concatenation(group_size):
    gen = torch.Generator().manual_seed(0)
    k, widths = 256, (384, 128, 128)
    ws = [torch.randn(k, n, generator=gen) for n in widths]
    qs, ss = zip(*(packing.quantize(w, group_size) for w in ws))
    packed = [packing.pack(q, s) for q, s in zip(qs, ss)]
    b_q, b_scales = packing.pack(torch.cat(qs, dim=1), torch.cat(ss, dim=1))
    assert torch.equal(torch.cat([p[0] for p in packed], dim=1), b_q)
    assert torch.equal(torch.cat([p[1] for p in packed], dim=1), b_scales)


def _layer(k, n, bias, seed, group_size=128):
    return MarlinLinear.from_linear(random_linear(k, n, bias, seed), group_size)


def test_fuse_group_computes_the_parts_side_by_side():
    parts = [_layer(256, 256, True, 1), _layer(256, 128, False, 2), _layer(256, 128, True, 3)]
    fused = fuse_group(parts)
    assert (fused.in_features, fused.out_features, fused.bias.shape) == (256, 512, (512,))
    assert not fused.workspace.any() and all(fused.workspace is not p.workspace for p in parts)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(4)).half()
    with torch.no_grad():
        assert torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=-1))
        # and it is the right answer, not only a consistent one
        w = torch.cat([packing.dequantize(*packing.unpack(p.b_q, p.b_scales)) for p in parts], dim=1)
        b = torch.cat([p.bias.double() if p.bias is not None else torch.zeros(p.out_features).double() for p in parts])
        assert rel_err(fused(x), x.double() @ w.double() + b) < 1e-3


def test_parts_that_cannot_share_a_gemm_are_refused():
    a, b = _layer(256, 128, False, 1), _layer(256, 128, False, 2, group_size=-1)
    with pytest.raises(ValueError, match="b_scales"):
        fuse_group([a, b])
    with pytest.raises(ValueError, match="different in_features"):
        fuse_group([a, _layer(384, 128, False, 3)])
    a.perm = torch.randperm(256).int()
    c = _layer(256, 128, False, 4)
    c.perm = torch.randperm(256).int()
    with pytest.raises(ValueError, match="act-order permutations"):
        fuse_group([a, c])
    c.perm = a.perm.clone()
    fused = fuse_group([a, c])  # the same permutation: fine
    x = torch.randn(3, 256).half()
    with torch.no_grad():
        assert torch.equal(fused(x), torch.cat([a(x), c(x)], dim=-1))


def test_parts_called_in_any_order_or_with_other_inputs():
    parent = torch.nn.Module()
    parts = [_layer(256, 128, False, i) for i in range(3)]
    for name, p in zip(("q_proj", "k_proj", "v_proj"), parts):
        parent.add_module(name, copy.deepcopy(p))
    report = fuse_projections(parent)
    assert report.fused == [("qkv_proj", ["q_proj", "k_proj", "v_proj"])]
    assert isinstance(parent.k_proj, FusedPart) and set(parent.state_dict()) >= {"qkv_proj.b_q", "qkv_proj.b_scales"}
    assert not any(k.startswith(("q_proj", "k_proj", "v_proj")) for k in parent.state_dict())
    x, y = torch.randn(2, 256).half(), torch.randn(2, 256).half()
    with torch.no_grad():
        assert torch.equal(parent.v_proj(x), parts[2](x))
        assert torch.equal(parent.q_proj(y), parts[0](y))  # another input: recomputed, not the cached x
        assert torch.equal(parent.k_proj(x), parts[1](x))
        assert torch.equal(parent.k_proj(y), parts[1](y))
        assert torch.equal(parent.v_proj(y), parts[2](y))
    assert parent.q_proj._shared.x is None or parent.q_proj._shared.unread > 0


def _family_model(family: str):
    base = tiny_llama_config()
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "vocab_size", "max_position_embeddings")
    kwargs = {k: getattr(base, k) for k in keys}
    cls, cfg = {
        "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig),
        "mistral": (transformers.MistralForCausalLM, transformers.MistralConfig),
        "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config),  # q/k/v with bias
    }[family]
    torch.manual_seed(0)
    return cls(cfg(**kwargs)).half().eval()


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_fused_model_matches_unfused(family):
    model = _family_model(family)
    marlin.replace_linear(model)
    unfused, ids = assert_fusing_keeps_logits(model, seq_len=7, seed=1)
    kw = dict(max_new_tokens=4, do_sample=False)
    assert torch.equal(model.generate(ids[:1], **kw), unfused.generate(ids[:1], **kw))


def test_replace_linear_fuse_flag():
    model = _family_model("llama")
    ref = copy.deepcopy(model)
    report = marlin.replace_linear(model, fuse=True)
    marlin.replace_linear(ref)
    assert report.fused is not None and len(report.fused.fused) == 4
    assert isinstance(model.model.layers[1].mlp.gate_proj, FusedPart)
    ids = torch.randint(0, 1000, (1, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)


def test_float_layers_and_partial_groups_are_reported():
    model = _family_model("llama")
    marlin.replace_linear(model, exclude=("lm_head", "layers.0.self_attn.k_proj"))
    del model.model.layers[1].mlp.up_proj
    report = fuse_projections(model)
    skipped = dict(report.skipped)
    assert "not all parts are MarlinLinear" in skipped["model.layers.0.self_attn.qkv_proj"]
    assert "not all of" in skipped["model.layers.1.mlp.gate_up_proj"]
    assert len(report.fused) == 2
    with pytest.raises(ValueError, match="cannot fuse model.layers.0.self_attn.qkv_proj"):
        fuse_projections(model, strict=True)


def test_compiled_fused_model_runs_one_gemm_per_group():
    # fullgraph tracing with the fake kernel; each group must become a single marlin.gemm call.
    model = _family_model("llama")
    marlin.replace_linear(model, fuse=True)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    layer = model.model.layers[0]
    hidden = torch.randn(1, 3, 256).half()
    pos = torch.arange(3)[None]
    emb = model.model.rotary_emb(hidden, pos)
    compiled = torch.compile(layer, backend=backend, fullgraph=True)
    with torch.no_grad():
        out = compiled(hidden, position_embeddings=emb)
        ref = layer(hidden, position_embeddings=emb)
    out = out[0] if isinstance(out, tuple) else out
    ref = ref[0] if isinstance(ref, tuple) else ref
    assert torch.equal(out, ref)
    gemms = [n for g in graphs for n in g.graph.nodes if n.target in (torch.ops.marlin.gemm, torch.ops.marlin.gemm.default)]
    assert len(graphs) == 1 and len(gemms) == 4  # qkv, o, gate_up, down


def test_fuse_a_loaded_checkpoint(tmp_path):
    # from_pretrained of a converted GPTQ checkpoint; without act-order every group fuses, with the
    # test writer's act-order (a different random order per layer) the groups stay apart.
    from marlin.convert import convert_gptq_checkpoint
    from test_convert import llama_gptq_checkpoint

    src, ref = llama_gptq_checkpoint(tmp_path, act_order=False)
    convert_gptq_checkpoint(src, tmp_path / "dst", quiet=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "dst")
    assert_fusing_keeps_logits(model)
    src2, _ = llama_gptq_checkpoint(tmp_path / "ao", act_order=True)
    convert_gptq_checkpoint(src2, tmp_path / "dst2", quiet=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "dst2")
    report = fuse_projections(model)
    assert not report.fused and all("act-order" in why for _, why in report.skipped)


def test_fused_model_in_continuous_batching():
    # transformers' continuous batching flattens requests into one token dimension and uses its
    # paged cache; every token a fused Marlin model generates there must be the greedy choice of
    # the same model run plainly on that prefix. On a CUDA machine it runs on the GPU (transformers
    # does not serve a CPU model there), where fp16 kernels differ slightly: hence the tolerance.
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = _family_model("llama").to(dev)
    marlin.replace_linear(model, fuse=True)
    model.generation_config.eos_token_id = -1
    prompts = [torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 9)]
    small = transformers.ContinuousBatchingConfig(num_blocks=8, max_batch_tokens=64)  # not most of the GPU
    out = model.generate_batch(prompts, max_new_tokens=4, warmup=False, continuous_batching_config=small)
    assert len(out) == 2
    for r in out.values():
        seq = torch.tensor([list(r.prompt_ids) + list(r.generated_tokens)], device=dev)
        assert seq.shape[1] == len(r.prompt_ids) + 4
        with torch.no_grad():
            logits = model(seq).logits[0].float()
        for pos in range(len(r.prompt_ids), seq.shape[1]):
            step = logits[pos - 1]
            assert step[seq[0, pos]] >= step.max() - 2e-2, (r.request_id, pos)
