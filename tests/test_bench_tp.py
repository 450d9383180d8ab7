"""benchmarks/bench_tp.py runs end to end on the CPU (tiny shape, one process) and writes its results."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import bench_tp


def test_dry_run_writes_every_kind(tmp_path, monkeypatch, capsys):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    out = tmp_path / "tp.json"
    assert bench_tp.main(["--dry-run", "--batches", "1,2", "--kinds", "fp16,marlin,marlin_24", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["meta"]["world_size"] == 1 and result["meta"]["shape"]["layers"] == 2
    assert result["meta"]["inductor_pdl"] is False  # the dry run does not compile: nothing to launch
    assert result["meta"]["attention"] == "marlin_decode"  # compile_for_decode's attention, the default
    runs = {r["kind"]: r for r in result["runs"]}
    assert set(runs) == {"fp16", "marlin", "marlin_24"}
    for run in runs.values():
        assert [p["batch"] for p in run["points"]] == [1, 2]
        assert all(p["tokens_per_s"] > 0 and p["graph"] is False for p in run["points"])
    # 4-bit weights are about a quarter of the FP16 bytes (plus the group-128 scales)
    ratio = runs["marlin"]["weight_bytes_per_rank"] / runs["fp16"]["weight_bytes_per_rank"]
    assert 0.25 < ratio < 0.27
    # 2:4: 2 bits of values and 1 of indices per weight, plus the scales: 3.125 / 16 of FP16
    ratio = runs["marlin_24"]["weight_bytes_per_rank"] / runs["fp16"]["weight_bytes_per_rank"]
    assert 0.19 < ratio < 0.20
    out = capsys.readouterr().out
    assert "marlin / fp16" in out and "marlin_24 / fp16" in out


def test_kinds_are_checked():
    with pytest.raises(ValueError, match="kind = 'int3'"):
        bench_tp.random_linear("int3", 64, 64, "cpu", None)


def _result(world, runs):
    return {
        "meta": {"kind": "tp", "world_size": world, "gpu": "H200", "prompt": 64, "steps": 64, "repeats": 5,
                 "shape": {"layers": 80}},
        "runs": [{"kind": k, "points": [{"batch": b, "tokens_per_s": v} for b, v in pts.items()]} for k, pts in runs.items()],
    }


def test_report_tables_and_cross_world_comparison(tmp_path):
    from benchmarks import report

    (tmp_path / "h200x2-tp.json").write_text(json.dumps(_result(2, {"fp16": {1: 20.0, 16: 300.0}, "marlin": {1: 50.0, 16: 630.0}})))
    (tmp_path / "h200x1-tp.json").write_text(json.dumps(_result(1, {"marlin": {1: 30.0, 16: 420.0}})))
    msgs = report.report(tmp_path / "h200x2-tp.json", tmp_path)
    md = (tmp_path / "h200x2-tp.md").read_text()
    assert "| 1 | 20.0 | 50.0 | 2.50x |" in md and "| 16 | 300.0 | 630.0 | 2.10x |" in md
    assert "marlin TP=1 / fp16 TP=2" in md and "| 1 | 30.0 | 20.0 | 50.0 | 1.50x |" in md
    assert (tmp_path / "h200x2-tp.png").stat().st_size > 0 and len(msgs) == 2
    # a 2:4 run beside them: its own ratio columns in both tables
    (tmp_path / "h200x2-tp.json").write_text(json.dumps(_result(2, {"fp16": {1: 20.0}, "marlin": {1: 50.0}, "marlin_24": {1: 60.0}})))
    (tmp_path / "h200x1-tp.json").write_text(json.dumps(_result(1, {"marlin": {1: 30.0}, "marlin_24": {1: 36.0}})))
    report.report(tmp_path / "h200x2-tp.json", tmp_path)
    md = (tmp_path / "h200x2-tp.md").read_text()
    assert "| 1 | 20.0 | 50.0 | 60.0 | 2.50x | 3.00x |" in md
    assert "marlin_24 TP=1 / fp16 TP=2" in md and "| 1 | 30.0 | 36.0 | 20.0 | 50.0 | 60.0 | 1.50x | 1.80x |" in md


@pytest.mark.parametrize("kind", ["fp16", "marlin"])
def test_compiled_step_matches_the_eager_one(kind):
    """The torch.compile'd element-wise code (fused residual add + norm, rotary, SiLU-mul) writes the
    same cache entries and picks the same tokens as the eager functions."""
    from benchmarks.tp_model import DecodeModel

    models = [DecodeModel(bench_tp.TINY, kind, 8, 0, 1, torch.device("cpu"), compile=c) for c in (False, True)]
    for m in models:
        torch.manual_seed(0)  # the random "prompt" in the cache comes from the global generator
        m.prepare(3)
        m.pos.fill_(4)
        m.step()
        m.step()
    eager, comp = models
    assert comp.ops.compiled and not eager.ops.compiled
    assert int(comp.pos) == int(eager.pos) == 6
    written = slice(4, 6)  # the two positions the steps wrote; the rest is the random "prompt"
    for a, b in ((eager.cache_k, comp.cache_k), (eager.cache_v, comp.cache_v)):
        assert torch.isfinite(a[..., written, :]).all()
        torch.testing.assert_close(b[..., written, :].float(), a[..., written, :].float(), atol=2e-2, rtol=2e-2)
        assert not torch.equal(a[..., written, :], torch.zeros_like(a[..., written, :]))
    assert torch.equal(comp.ids, eager.ids)


@pytest.mark.parametrize("kind", ["fp16", "marlin"])
def test_decode_attention_step_matches_sdpa(kind):
    """The step on marlin's decode attention writes the cache entries and picks the tokens of the
    step on SDPA (the model's mask hides the cache past the position)."""
    from benchmarks.tp_model import DecodeModel

    models = [DecodeModel(bench_tp.TINY, kind, 8, 0, 1, torch.device("cpu"), attention=a)
              for a in ("sdpa", "marlin_decode")]
    for m in models:
        torch.manual_seed(0)
        m.prepare(3)
        m.pos.fill_(4)
        m.step()
        m.step()
    sdpa, mine = models
    for a, b in ((sdpa.cache_k, mine.cache_k), (sdpa.cache_v, mine.cache_v)):
        torch.testing.assert_close(b.float(), a.float(), atol=2e-3, rtol=2e-3)
    assert torch.equal(sdpa.ids, mine.ids)


def test_fused_qkv_layer_writes_the_rotated_k_of_its_k_rows():
    """Layer 0's first cache write is rotary(RMSNorm(embedding) @ W_k), with W_k the k rows of the fused
    q/k/v weight (after the q rows), recomputed here in float64: catches a wrong split or order."""
    from benchmarks.tp_model import DecodeModel

    s = bench_tp.TINY
    m = DecodeModel(s, "fp16", 8, 0, 1, torch.device("cpu"))
    m.prepare(2)
    m.pos.fill_(3)
    ids = m.ids.clone()
    m.step()
    x = m.embed[ids].double()
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + s.rms_eps)
    w = m.layers[0].qkv.local.weight.double()
    q_rows, kv_rows = s.heads * s.head_dim, s.kv_heads * s.head_dim
    k = (h @ w[q_rows : q_rows + kv_rows].T).view(2, s.kv_heads, s.head_dim)
    v = (h @ w[q_rows + kv_rows :].T).view(2, s.kv_heads, s.head_dim)
    cos, sin = m.cos[3].double(), m.sin[3].double()
    k = k * cos + torch.cat((-k[..., s.head_dim // 2 :], k[..., : s.head_dim // 2]), -1) * sin
    torch.testing.assert_close(m.cache_k[0][:, :, 3].double(), k, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(m.cache_v[0][:, :, 3].double(), v, atol=2e-2, rtol=2e-2)


def test_profiled_batches_carry_kernel_time_by_category(tmp_path, monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    out = tmp_path / "tp.json"
    assert bench_tp.main(["--dry-run", "--batches", "1,2", "--kinds", "marlin", "--profile-batches", "2",
                          "--out", str(out)]) == 0
    points = {p["batch"]: p for p in json.loads(out.read_text())["runs"][0]["points"]}
    assert "profile" not in points[1]
    prof = points[2]["profile"]
    cats = prof["us_per_step_by_category"]
    # two layers: four Marlin GEMMs each (q|k|v, o, gate|up, down), lm_head FP16
    assert cats["marlin GEMM"] > 0 and prof["calls_per_step_by_category"]["marlin GEMM"] >= 8
    assert prof["kernel_us_per_step"] == pytest.approx(sum(cats.values()), abs=0.1)
    assert "idle_us_per_step" in prof
    from benchmarks import report

    report.report(out, tmp_path)
    md = (tmp_path / "tp.md").read_text()
    assert "## Where a step's time goes" in md and "| marlin | 2 |" in md and "marlin GEMM" in md


def test_profile_drops_its_warm_up_step_and_aligns_each_recorded_one():
    # calls per step must be exact: a warm-up step counted in would make the single matmul 1.25 per step
    from benchmarks.kernel_profile import profile_calls

    x = torch.randn(32, 32, dtype=torch.float64)
    aligned = []
    prof = profile_calls(lambda: x @ x, lambda: None, torch.device("cpu"), steps=4, align=lambda: aligned.append(1))
    assert prof["calls_per_step_by_category"]["FP16 GEMM"] == 1.0
    assert len(aligned) == 5  # the dropped warm-up step and the four recorded ones
    # the profiler's step annotations span whole steps: counted, they would double the sum
    assert not any(k["name"].startswith("ProfilerStep") for k in prof["top_kernels"])


def test_report_flags_profiles_longer_than_their_step(tmp_path):
    from benchmarks.report_tp import _profile_lines

    point = {"batch": 1, "ms_per_step": 10.0, "profile": {"us_per_step_by_category": {"collectives (NCCL / gloo)": 2e5},
                                                          "idle_us_per_step": -1.9e5}}
    lines = _profile_lines({"runs": [{"kind": "marlin", "points": [point]}]})
    assert any("negative idle time" in line for line in lines)
    point["profile"] = {"us_per_step_by_category": {"marlin GEMM": 8e3}, "idle_us_per_step": 2e3}
    assert not any("negative idle time" in line for line in _profile_lines({"runs": [{"kind": "marlin", "points": [point]}]}))


def test_kernel_categories():
    from benchmarks.kernel_profile import category

    assert category("ncclDevKernel_AllReduce_Sum_f16_RING_LL(ncclDevKernelArgsStorage<4096ul>)") == "collectives (NCCL / gloo)"
    assert category("gloo:all_reduce") == "collectives (NCCL / gloo)"
    assert category("triton_red_fused_add_mean_mul_pow_rsqrt_0") == "fused elementwise (inductor)"
    assert category("void marlin::marlin_smallm_kernel<1, 8>") == "marlin GEMM"
    assert category("nvjet_hsh_64x8_64x16_2x1_v_bz_splitK_TNT") == "FP16 GEMM"


def test_report_sets_the_collectives_alone_beside_the_other_kernels():
    # with the collectives timed alone, the eager profile's collectives column (waits for the other
    # ranks' launches included) is left out; rest = step - the other kernels, beside the collectives alone
    from benchmarks.report_tp import _profile_lines

    prof = {"us_per_step_by_category": {"marlin GEMM": 6e3, "collectives (NCCL / gloo)": 2e5, "attention": 1e3},
            "idle_us_per_step": -1.9e5, "collectives_alone_us_per_step": 1.5e3}
    point = {"batch": 1, "ms_per_step": 10.0, "profile": prof}
    lines = _profile_lines({"runs": [{"kind": "marlin", "points": [point]}]})
    head = next(line for line in lines if line.startswith("| kind"))
    assert "collectives (NCCL" not in head and "rest: collectives + gaps | collectives alone" in head
    row = next(line for line in lines if line.startswith("| marlin |"))
    assert row == "| marlin | 1 | 10.00 | 6.00 | 1.00 | 3.00 | 1.50 |"
    assert not any("negative idle time" in line for line in lines)
    assert not any("programmatic dependent launch" in line for line in lines)
    # with inductor's PDL on (meta), the report says what it does to the kernel columns
    pdl = _profile_lines({"meta": {"inductor_pdl": True}, "runs": [{"kind": "marlin", "points": [point]}]})
    assert any("With programmatic dependent launch a kernel may start" in line for line in pdl)


def test_report_says_whether_inductor_ran_with_pdl():
    from benchmarks.report_tp import _model_code

    on = _model_code({"compiled": True, "fused_projections": True, "inductor_pdl": True})
    off = _model_code({"compiled": True, "fused_projections": True, "inductor_pdl": False})
    older = _model_code({"compiled": True, "fused_projections": True})
    assert "with programmatic dependent launch" in on and "without programmatic dependent launch" in off
    assert "programmatic" not in older and "programmatic" not in _model_code({"compiled": False})
