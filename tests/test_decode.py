"""marlin.compile_for_decode: generate() with a static cache and a compiled decode step.

On the CPU the step is traced with fullgraph=True through a recording backend (the op's fake
kernel gives the shapes; no C++ compiler needed) and must give the eager model's tokens. On a GPU
the default set-up (inductor, reduce-overhead: CUDA graphs) runs on a tiny Llama.
"""

from __future__ import annotations

import copy

import pytest
import torch

import marlin
from marlin.decode import compile_for_decode
from marlin.fuse import FusedPart

from conftest import requires_cuda, tiny_llama_config

transformers = pytest.importorskip("transformers")


def tiny_marlin_llama(device="cpu"):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_llama_config()).half().to(device).eval()
    marlin.replace_linear(model)
    return model


def prompt(batch=2, seq=7, device="cpu"):
    ids = torch.randint(0, 1000, (batch, seq), generator=torch.Generator().manual_seed(5)).to(device)
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids))


def test_compiled_decode_on_cpu_gives_the_eager_tokens():
    model = tiny_marlin_llama()
    eager = copy.deepcopy(model)
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    assert compile_for_decode(model, backend=record, mode=None, compile_on_cpu=True) is model
    assert model.generation_config.cache_implementation == "static"
    assert len(model.marlin_decode.fused.fused) == 4 and isinstance(model.model.layers[0].self_attn.q_proj, FusedPart)
    kw = dict(max_new_tokens=5, do_sample=False)
    out = model.generate(**prompt(), **kw)
    assert torch.equal(out, eager.generate(**prompt(), **kw))
    # the decode steps ran compiled: one graph (fullgraph), four GEMMs per layer (qkv, o, gate_up, down)
    assert len(graphs) == 1
    gemms = [n for n in graphs[0].graph.nodes if n.target in (torch.ops.marlin.gemm, torch.ops.marlin.gemm.default)]
    assert len(gemms) == 4 * model.config.num_hidden_layers


def test_without_fusion_and_bad_input():
    model = tiny_marlin_llama()
    compile_for_decode(model, fuse=False, compile_on_cpu=True, backend="eager", mode=None)
    assert model.marlin_decode.fused is None and type(model.model.layers[0].self_attn.q_proj) is marlin.MarlinLinear
    with pytest.raises(TypeError, match="expected a transformers generative model"):
        compile_for_decode(torch.nn.Linear(4, 4))


def test_pdl_option():
    """compile_for_decode's pdl: inductor's options with triton.enable_pdl, the mode's own options
    folded in (torch.compile takes a mode or options, not both), by default where the backend is
    inductor and this torch has the option; pdl=True gives a clear error with another backend or
    where this torch's inductor has no such option."""
    from marlin.decode import inductor_pdl_supported

    model = tiny_marlin_llama()
    if not inductor_pdl_supported():
        with pytest.raises(ValueError, match="enable_pdl"):
            compile_for_decode(model, pdl=True, compile_on_cpu=True)
        compile_for_decode(model, compile_on_cpu=True)  # the default: off, without an error
        assert model.marlin_decode.compile_config.mode == "reduce-overhead"
        return
    compile_for_decode(model, pdl=True, compile_on_cpu=True)
    cc = model.marlin_decode.compile_config
    assert cc.mode is None and cc.options == {"triton.cudagraphs": True, "triton.enable_pdl": True}
    compile_for_decode(model, fuse=False, pdl=True, mode=None, options={"max_autotune": True}, compile_on_cpu=True)
    assert model.generation_config.compile_config.options == {"triton.enable_pdl": True, "max_autotune": True}
    with pytest.raises(ValueError, match="pdl=True needs backend='inductor', got backend='eager'"):
        compile_for_decode(model, fuse=False, pdl=True, backend="eager", compile_on_cpu=True)
    # on by default where it can be; pdl=False and other backends: the caller's mode and options as given
    compile_for_decode(model, fuse=False, compile_on_cpu=True)
    cc = model.generation_config.compile_config
    assert cc.mode is None and cc.options == {"triton.cudagraphs": True, "triton.enable_pdl": True}
    compile_for_decode(model, fuse=False, pdl=False, compile_on_cpu=True)
    cc = model.generation_config.compile_config
    assert cc.mode == "reduce-overhead" and cc.options is None
    compile_for_decode(model, fuse=False, backend="eager", mode=None, compile_on_cpu=True)
    cc = model.generation_config.compile_config
    assert cc.backend == "eager" and cc.options is None


def _check_tokens_are_greedy(model_eager, sequences, prompt_len, tol):
    """Every generated token is (within tol of) the eager model's argmax given the same prefix."""
    with torch.no_grad():
        logits = model_eager(sequences).logits.float()
    for pos in range(prompt_len, sequences.shape[1]):
        step = logits[:, pos - 1]
        chosen = step.gather(1, sequences[:, pos : pos + 1]).squeeze(1)
        assert (chosen >= step.max(dim=1).values - tol).all(), pos


@requires_cuda
def test_compiled_decode_on_cuda():
    model = tiny_marlin_llama("cuda")
    eager = copy.deepcopy(model)
    compile_for_decode(model)
    p = prompt(device="cuda")
    for _ in range(2):  # the second call replays the captured graphs
        out = model.generate(**p, max_new_tokens=8, do_sample=False)
        assert out.shape == (2, 15)
        _check_tokens_are_greedy(eager, out, 7, tol=2e-2)
    assert hasattr(model, "_compiled_call")


@requires_cuda
def test_compiled_decode_with_pdl_matches_without():
    """Inductor's kernels with programmatic dependent launch (compute capability 9.0+) start under
    the previous kernel's tail and must wait for what they read: the compiled step with pdl=True
    gives the eager model's greedy tokens and the scores of the step without it (a missed wait
    would read a previous kernel's output before it is written). Not bit for bit: each
    compilation autotunes its reductions on its own."""
    from marlin.decode import inductor_pdl_supported

    if not inductor_pdl_supported() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch: inductor's enable_pdl and compute capability 9.0+")
    model = tiny_marlin_llama("cuda")
    eager, with_pdl = copy.deepcopy(model), copy.deepcopy(model)
    compile_for_decode(model, pdl=False)
    compile_for_decode(with_pdl, pdl=True)
    p = prompt(device="cuda")
    kw = dict(max_new_tokens=8, do_sample=False, output_scores=True, return_dict_in_generate=True)
    for _ in range(2):  # the second call replays the captured graphs
        ref, out = model.generate(**p, **kw), with_pdl.generate(**p, **kw)
        _check_tokens_are_greedy(eager, out.sequences, 7, tol=2e-2)
        if torch.equal(out.sequences, ref.sequences):  # the same prefixes: the same scores, to rounding
            for a, b in zip(out.scores, ref.scores):
                assert (a.float() - b.float()).abs().max() <= 1e-2 * b.float().abs().max(), (a, b)


def test_compiled_decode_of_a_loaded_checkpoint(tmp_path):
    # from_pretrained attaches marlin's quantizer; generate() compiles only if it says the model
    # is compileable, so the recording backend must see the decode step.
    from marlin.convert import convert_gptq_checkpoint
    from test_convert import llama_gptq_checkpoint

    src, _ = llama_gptq_checkpoint(tmp_path, act_order=False)
    convert_gptq_checkpoint(src, tmp_path / "dst", quiet=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "dst")
    eager = copy.deepcopy(model)
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compile_for_decode(model, backend=record, mode=None, compile_on_cpu=True)
    kw = dict(max_new_tokens=4, do_sample=False)
    assert torch.equal(model.generate(**prompt(), **kw), eager.generate(**prompt(), **kw))
    assert len(graphs) == 1


def test_inductor_compiles_the_fused_step_on_cpu():
    # The benchmark's compiled mode (what compile_for_decode asks of torch.compile): inductor, one
    # graph with no breaks, one marlin.gemm per fused group, and the eager model's logits. Inductor
    # checks each op's output sizes and strides against its fake kernel, so a fake kernel that
    # lies about them fails here and not only on a GPU.
    from torch._dynamo.utils import counters

    from benchmarks.e2e_model import DecodeStep, compile_decode

    model = tiny_marlin_llama()
    marlin.fuse_projections(model, strict=True)
    torch._dynamo.reset()
    counters.clear()
    step = DecodeStep(model, 2, 8, 4, torch.device("cpu"), seed=1)
    fn = step.setup("compiled", compile_decode("compiled", "inductor"))
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    assert step.check(fn) < 1e-2
    # a second step (next position) from the compiled function agrees with eager as well
    step.reset(step.prompt_len + 1)
    out = fn().float()
    step.reset(step.prompt_len + 1)
    ref = step.eager_call()().float()
    assert ((out - ref).norm() / ref.norm()).item() < 1e-2
    torch._dynamo.reset()
