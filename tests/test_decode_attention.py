"""torch.ops.marlin.decode_attention and transformers' "marlin_decode" attention.

Every case is checked against SDPA's definition in float64 (softmax(scale * q.k + mask) @ v,
keys and values repeated per query-head group), with masks that have holes, a masked tail and a
masked head, so a wrong scale, a dropped block, a split combined wrongly, a GQA head paired with
the wrong key/value head or a mask read from the wrong row shows up as an O(1) error.

The Triton kernel runs on CUDA, and on the CPU in Triton's interpreter (TRITON_INTERPRET=1, in a
subprocess: the variable is read when the kernels are defined). The interpreter's bfloat16 tl.dot
is broken in triton 3.9 (a plain 16x16 bf16 dot is off by 1e10 there), so it runs fp16 and fp32;
the GPU tests run every dtype.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import marlin  # noqa: F401  (registers the ops)
from conftest import requires_cuda, tiny_llama_config
from marlin.attention import decode_op, masked_below, split_count

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# (batch, query heads, key/value heads, positions, head size)
SHAPES = [
    (1, 4, 4, 1, 64),      # one position
    (2, 4, 4, 100, 64),    # MHA, a partial last block
    (3, 8, 2, 300, 128),   # GQA 4
    (2, 8, 1, 129, 80),    # MQA, head size not a power of two
    (1, 32, 32, 700, 128),  # Llama-2-7B heads, several splits on a small GPU
    (4, 28, 4, 64, 128),   # GQA 7 (Qwen2-7B), one block
]
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5}


def ref64(q, k, v, vis, bias, scale):
    """SDPA's definition in float64: vis [B, N] bool (None: all visible), bias [B, N] additive or None."""
    b, h, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    kk = k.double().repeat_interleave(h // hkv, dim=1)
    vv = v.double().repeat_interleave(h // hkv, dim=1)
    s = torch.einsum("bhd,bhnd->bhn", q.double(), kk) * scale
    if bias is not None:
        s = s + bias.double()[:, None, :]
    if vis is not None:
        s = s.masked_fill(~vis[:, None, :], float("-inf"))
    return torch.einsum("bhn,bhnd->bhd", torch.softmax(s, dim=-1), vv)


def make_case(b, h, hkv, n, d, dtype, mask_kind, seed, device="cpu"):
    """q, k, v, the op's mask, and the reference's (vis, bias). Each row sees a random prefix with
    holes in its first positions and a masked head of a few positions in one row."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, d, generator=gen).to(dtype)
    k = torch.randn(b, hkv, n, d, generator=gen).to(dtype)
    v = torch.randn(b, hkv, n, d, generator=gen).to(dtype)
    lens = torch.randint(1, n + 1, (b,), generator=gen)
    pos = torch.arange(n)
    vis = pos[None, :] < lens[:, None]
    if n > 8:
        vis[:, :6] &= torch.rand(b, 6, generator=gen) > 0.5  # holes
        vis[0, :3] = False  # a masked head
        vis[torch.arange(b), lens - 1] = True
        vis[0, min(3, n - 1)] = True
    bias = None
    if mask_kind == "bool":
        mask = vis
    elif mask_kind == "additive":  # as transformers writes it: 0 or finfo.min, plus a small real bias
        soft = (torch.randn(b, n, generator=gen) * 0.5).to(dtype)
        mask = soft.masked_fill(~vis, torch.finfo(dtype).min)
        bias = soft
    elif mask_kind == "broadcast":  # one [1, N] mask for the whole batch
        vis = vis[:1].expand(b, n)
        mask = vis[:1]
    else:
        vis, mask = None, None
    to = dict(device=device)
    return (q.to(**to), k.to(**to), v.to(**to), None if mask is None else mask.to(**to),
            None if vis is None else vis, bias)


def check(out, q, k, v, vis, bias, scale, dtype):
    ref = ref64(q.cpu(), k.cpu(), v.cpu(), vis, None if bias is None else bias, scale)
    assert out.dtype == dtype and out.shape == q.shape
    err = (out.cpu().double() - ref).abs().max().item()
    assert err <= TOL[dtype] * max(1.0, ref.abs().max().item()), err


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("mask_kind", ["bool", "additive", "broadcast", "none"])
def test_op_cpu_matches_sdpa_definition(shape, dtype, mask_kind):
    b, h, hkv, n, d = shape
    q, k, v, mask, vis, bias = make_case(b, h, hkv, n, d, dtype, mask_kind, seed=hash((shape, mask_kind)) % 1000)
    scale = d ** -0.5
    out = torch.ops.marlin.decode_attention(q, k, v, mask, scale)
    check(out, q, k, v, vis, bias, scale, dtype)


def test_op_strided_inputs_and_batch_zero():
    # q as transformers hands it ([B, H, 1, D] -> [B, H, D] view), k/v one layer of a bigger cache
    q = torch.randn(2, 1, 4, 64).transpose(1, 2)[:, :, 0, :]
    cache = torch.randn(3, 2, 2, 50, 64)
    k, v = cache[1], cache[2]
    out = torch.ops.marlin.decode_attention(q, k, v, None, 0.125)
    check(out, q, k, v, None, None, 0.125, torch.float32)
    empty = torch.ops.marlin.decode_attention(q[:0], k[:0], v[:0], None, 0.125)
    assert empty.shape == (0, 4, 64)


def test_fully_masked_row_gives_zeros():
    q, k, v = torch.randn(2, 4, 32), torch.randn(2, 4, 16, 32), torch.randn(2, 4, 16, 32)
    mask = torch.ones(2, 16, dtype=torch.bool)
    mask[1] = False
    out = torch.ops.marlin.decode_attention(q, k, v, mask, 0.2)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    check(out[:1], q[:1], k[:1], v[:1], mask[:1], None, 0.2, torch.float32)


def test_masked_below_is_half_of_the_dtypes_min():
    assert masked_below(torch.float16) == -65504.0 / 2
    assert masked_below(torch.bfloat16) == float(torch.finfo(torch.bfloat16).min) / 2


@pytest.mark.parametrize(
    "batch, kv_heads, n, sms, want",
    [(1, 32, 128, 132, 1), (1, 32, 4096, 132, 8), (1, 8, 4096, 132, 16), (64, 32, 4096, 132, 1), (1, 1, 300, 4, 2)],
)
def test_split_count(batch, kv_heads, n, sms, want):
    assert split_count(batch, kv_heads, n, sms) == want


@pytest.mark.parametrize(
    "args, msg",
    [
        ((torch.randn(2, 4, 1, 8), torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8), None), "q must be"),
        ((torch.randn(2, 4, 8), torch.randn(2, 4, 5, 8), torch.randn(2, 4, 6, 8), None), "differ"),
        ((torch.randn(2, 4, 8), torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 8), None), "not a multiple"),
        ((torch.randn(2, 4, 8), torch.randn(3, 4, 5, 8), torch.randn(3, 4, 5, 8), None), "expected the batch 2"),
        ((torch.randn(2, 4, 8), torch.randn(2, 4, 5, 4), torch.randn(2, 4, 5, 4), None), "head size"),
        ((torch.randn(2, 4, 8).half(), torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8), None), "dtypes"),
        ((torch.randn(2, 4, 8), torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8), torch.ones(2, 6, dtype=torch.bool)),
         "mask shape"),
        ((torch.randn(2, 4, 8), torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8), torch.ones(2, 5, dtype=torch.int32)),
         "mask.dtype"),
        ((torch.randint(0, 5, (2, 4, 8)), torch.randint(0, 5, (2, 4, 5, 8)), torch.randint(0, 5, (2, 4, 5, 8)), None),
         "q.dtype"),
    ],
)
def test_bad_inputs_name_the_argument(args, msg):
    with pytest.raises(RuntimeError, match=msg):
        torch.ops.marlin.decode_attention(*args, 1.0)


def test_opcheck_and_compile_cpu():
    q, k, v, mask, vis, bias = make_case(2, 8, 2, 40, 64, torch.float32, "additive", seed=1)
    torch.library.opcheck(torch.ops.marlin.decode_attention.default, (q, k, v, mask, 0.125))
    fn = torch.compile(lambda *a: torch.ops.marlin.decode_attention(*a, 0.125), backend="aot_eager", fullgraph=True)
    check(fn(q, k, v, mask), q, k, v, vis, bias, 0.125, torch.float32)


# ---- the Triton kernel in Triton's interpreter (CPU) -----------------------------------------

_INTERPRET_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    sys.path.insert(0, {root!r}); sys.path.insert(0, {here!r})
    from test_decode_attention import make_case, ref64, SHAPES
    from marlin.attention.decode_kernel import launch
    results = []
    for shape in SHAPES:
        b, h, hkv, n, d = shape
        # every mask kind in fp16, one each in the other dtypes (the interpreter is slow)
        for dtype, kind in [(torch.float16, "bool"), (torch.float16, "additive"), (torch.float16, "broadcast"),
                            (torch.float16, "none"), (torch.float32, "bool")]:  # no bf16 (module docstring)
            for sms in (132, 2):  # 2: as many splits as the positions allow
                q, k, v, mask, vis, bias = make_case(b, h, hkv, n, d, dtype, kind, seed=len(results))
                out = launch(q, k, v, mask, d ** -0.5, sms)
                ref = ref64(q, k, v, vis, bias, d ** -0.5)
                err = (out.double() - ref).abs().max().item() / max(1.0, ref.abs().max().item())
                results.append([list(shape), str(dtype), kind, sms, err, out.dtype == dtype])
    # strided views: q's and v's last dim with stride 2, k one layer of a bigger cache
    q, k, v, mask, vis, bias = make_case(2, 8, 2, 90, 64, torch.float16, "bool", seed=7)
    q2 = torch.zeros(2, 8, 128, dtype=torch.float16); q2[..., ::2] = q
    v2 = torch.zeros(2, 2, 90, 128, dtype=torch.float16); v2[..., ::2] = v
    k2 = torch.stack([torch.zeros_like(k), k])[1]
    out = launch(q2[..., ::2], k2, v2[..., ::2], mask, 0.125, 2)
    ref = ref64(q, k, v, vis, bias, 0.125)
    results.append([[2, 8, 2, 90, 64], "torch.float16", "strided", 2,
                    (out.double() - ref).abs().max().item() / max(1.0, ref.abs().max().item()), True])
    print(json.dumps(results))
    """
)


def test_triton_kernel_in_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", _INTERPRET_SCRIPT.format(root=ROOT, here=HERE)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) >= 55
    tol = {"torch.float16": 2e-3, "torch.bfloat16": 1.6e-2, "torch.float32": 1e-5}
    bad = [r for r in results if not (r[4] <= tol[r[1]] and r[5])]
    assert not bad, bad[:5]


# ---- transformers -------------------------------------------------------------------------------


def _tiny_llama(device="cpu", dtype=torch.float32):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = tiny_llama_config()
    cfg._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def _generate(model, ids, attn):
    with torch.no_grad():
        return model.generate(ids, attention_mask=attn, max_new_tokens=6, do_sample=False,
                              cache_implementation="static", output_scores=True, return_dict_in_generate=True,
                              pad_token_id=0)


def test_hf_marlin_decode_matches_sdpa_and_runs_the_op(monkeypatch):
    from marlin.integrations import hf_attention

    assert hf_attention.register()
    model = _tiny_llama()
    ids = torch.randint(1, 1000, (3, 9), generator=torch.Generator().manual_seed(0))
    attn = torch.ones_like(ids)
    attn[0, :4] = 0  # left padding: a masked head in the cache
    attn[2, :1] = 0
    want = _generate(model, ids, attn)
    calls = []
    real = decode_op._reference
    monkeypatch.setattr(decode_op, "_reference", lambda *a: calls.append(a[0].shape) or real(*a))
    model.set_attn_implementation(hf_attention.NAME)
    got = _generate(model, ids, attn)
    assert got.sequences.tolist() == want.sequences.tolist()
    err = max((x - y).abs().max().item() for x, y in zip(got.scores, want.scores))
    assert err < 1e-4, err
    # 5 one-token steps x 2 layers went through the op (the prompt went to SDPA)
    assert len(calls) == 10 and all(s == (3, 4, 64) for s in calls), calls


@pytest.mark.parametrize("family, extra", [("Mistral", {"sliding_window": 4}), ("Qwen2", {}), ("Qwen3", {"head_dim": 32}),
                                           ("Phi3", {"pad_token_id": 0})])
def test_hf_marlin_decode_other_families(family, extra, monkeypatch):
    """Other attention layouts transformers ships: a sliding window (its mask narrows the visible
    range), Qwen3's q/k norms and explicit head size, Phi3's fused qkv: the same tokens as SDPA."""
    transformers = pytest.importorskip("transformers")
    from marlin.integrations import hf_attention

    hf_attention.register()
    torch.manual_seed(0)
    cfg = getattr(transformers, family + "Config")(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                                                   num_key_value_heads=2, num_hidden_layers=2, vocab_size=100, **extra)
    cfg._attn_implementation = "sdpa"
    model = getattr(transformers, family + "ForCausalLM")(cfg).eval()
    ids = torch.randint(1, 100, (2, 9), generator=torch.Generator().manual_seed(1))
    attn = torch.ones_like(ids)
    attn[0, :3] = 0
    want = _generate(model, ids, attn)
    calls = []
    real = decode_op._reference
    monkeypatch.setattr(decode_op, "_reference", lambda *a: calls.append(1) or real(*a))
    model.set_attn_implementation(hf_attention.NAME)
    got = _generate(model, ids, attn)
    assert got.sequences.tolist() == want.sequences.tolist()
    assert max((x - y).abs().max().item() for x, y in zip(got.scores, want.scores)) < 1e-4
    assert len(calls) == 5 * 2  # every one-token step of both layers


def test_hf_falls_back_to_sdpa_for_what_the_op_does_not_take(monkeypatch):
    from marlin.integrations import hf_attention

    calls = []
    monkeypatch.setattr(decode_op, "_reference", lambda *a: calls.append(1))
    q, k, v = torch.randn(2, 4, 1, 16), torch.randn(2, 2, 10, 16), torch.randn(2, 2, 10, 16)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True
    per_head = torch.zeros(2, 4, 1, 10)  # a mask per head: not [B, 1, 1, N]
    out, _ = hf_attention.marlin_decode_attention_forward(module, q, k, v, per_head)
    want = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                            attn_mask=per_head).transpose(1, 2)
    torch.testing.assert_close(out, want)
    hf_attention.marlin_decode_attention_forward(module, q, k, v, None, dropout=0.1)
    hf_attention.marlin_decode_attention_forward(module, torch.randn(2, 4, 3, 16), k, v, None)  # a prompt
    hf_attention.marlin_decode_attention_forward(module, q, k, v, None, position_bias=torch.zeros(1, 4, 1, 10))
    assert calls == []


def test_compile_for_decode_sets_the_attention():
    model = _tiny_llama()
    marlin.compile_for_decode(model, fuse=False, attention="marlin_decode", pdl=False)
    assert model.config._attn_implementation == "marlin_decode" and model.marlin_decode.attention == "marlin_decode"
    marlin.compile_for_decode(model, fuse=False, attention="sdpa", pdl=False)
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match="attention='flash'"):
        marlin.compile_for_decode(model, fuse=False, attention="flash", pdl=False)


def test_compile_for_decode_auto_leaves_cpu_models_and_chosen_attentions():
    model = _tiny_llama()
    marlin.compile_for_decode(model, fuse=False, pdl=False)  # attention="auto"
    assert model.config._attn_implementation == "sdpa"  # a CPU model: left as it is
    assert model.marlin_decode.attention is None
    model.set_attn_implementation("eager")
    marlin.compile_for_decode(model, fuse=False, pdl=False)
    assert model.config._attn_implementation == "eager"


# ---- CUDA -----------------------------------------------------------------------------------------


@requires_cuda
@pytest.mark.parametrize("shape", SHAPES + [(1, 32, 32, 4096, 128), (2, 32, 8, 2000, 128), (64, 32, 32, 128, 128)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("mask_kind", ["bool", "additive", "broadcast", "none"])
def test_op_cuda_matches_sdpa_definition(shape, dtype, mask_kind):
    b, h, hkv, n, d = shape
    q, k, v, mask, vis, bias = make_case(b, h, hkv, n, d, dtype, mask_kind, seed=hash((shape, mask_kind)) % 1000,
                                         device="cuda")
    # the output comes from the caching allocator: fill the memory it will reuse with NaN first
    torch.full((b * h * d * 4 + 4096,), float("nan"), device="cuda")
    out = torch.ops.marlin.decode_attention(q, k, v, mask, d ** -0.5)
    check(out, q, k, v, vis, bias, d ** -0.5, dtype)
    again = torch.ops.marlin.decode_attention(q, k, v, mask, d ** -0.5)
    assert torch.equal(out, again)  # bitwise repeatable (no atomics)


@requires_cuda
def test_op_cuda_graph_and_compile():
    q, k, v, mask, vis, bias = make_case(4, 32, 8, 1500, 128, torch.float16, "additive", seed=5, device="cuda")
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.ops.marlin.decode_attention(q, k, v, mask, 0.088)  # compile the Triton kernels outside capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = torch.ops.marlin.decode_attention(q, k, v, mask, 0.088)
    q.copy_(torch.randn_like(q))
    g.replay()
    torch.cuda.synchronize()
    check(out, q, k, v, vis, bias, 0.088, torch.float16)
    fn = torch.compile(lambda a, b, c, m: torch.ops.marlin.decode_attention(a, b, c, m, 0.088), fullgraph=True)
    torch.testing.assert_close(fn(q, k, v, mask), out, rtol=0, atol=0)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_hf_marlin_decode_cuda_generate_compiled(dtype):
    from marlin.integrations import hf_attention

    hf_attention.register()
    model = _tiny_llama("cuda", dtype)
    ids = torch.randint(1, 1000, (3, 9), generator=torch.Generator().manual_seed(0)).cuda()
    attn = torch.ones_like(ids)
    attn[0, :4] = 0
    want = _generate(model, ids, attn)
    marlin.compile_for_decode(model, fuse=False)  # "auto": marlin_decode on CUDA with Triton
    assert model.config._attn_implementation == hf_attention.NAME
    got = _generate(model, ids, attn)
    err = max((x.float() - y.float()).abs().max().item() for x, y in zip(got.scores, want.scores))
    scale = max(y.float().abs().max().item() for y in want.scores)
    assert err <= (2e-2 if dtype == torch.float16 else 6e-2) * scale, (err, scale)
