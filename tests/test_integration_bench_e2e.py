"""benchmarks.bench_e2e and its report on the CPU (--dry-run: tiny Llama, CPU op, traced steps).

The numbers of a dry run mean nothing; what is checked is the pipeline: every (kernel, mode,
batch) point is timed, each traced step agrees with the eager forward, the speedups pair the
right points, and the report writes its figure and markdown.
"""

from __future__ import annotations

import json

import pytest
from conftest import requires_cuda

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from benchmarks import bench_e2e, report  # noqa: E402


@pytest.fixture(autouse=True)
def restore_inductor_pdl():
    """bench_e2e sets inductor's enable_pdl for the whole process (on by default where it exists):
    put it back after each test so that later tests compile as they would alone."""
    from marlin.decode import inductor_pdl_supported

    if not inductor_pdl_supported():
        yield
        return
    import torch._inductor.config as inductor_config

    with inductor_config.patch({"triton.enable_pdl": inductor_config.triton.enable_pdl}):
        yield


def test_dry_run_and_report(tmp_path):
    out = tmp_path / "e2e.json"
    rc = bench_e2e.main(["--dry-run", "--kernels", "fp16,marlin", "--modes", "eager,graph", "--out", str(out),
                         "--profile", "--profile-batches", "3"])
    assert rc == 0
    data = json.loads(out.read_text())
    meta, points = data["meta"], data["points"]
    assert meta["kind"] == "e2e" and meta["transformers"] and meta["model"] == "tiny" and "git_rev" in meta
    assert meta["complete"] and meta["profile_mode"] == "graph"
    # the traced step of each point: one graph per batch size, no graph breaks
    assert all(p["graph_breaks"] == 0 and p["new_graphs"] == 1 and p["setup_s"] >= 0 for p in points if p["mode"] == "graph")
    profs = data["profiles"]
    assert [(p["kernel"], p["mode"], p["batch"]) for p in profs] == [("fp16", "graph", 3), ("marlin", "graph", 3)]
    assert "marlin GEMM" in profs[1]["us_per_step_by_category"] and "marlin GEMM" not in profs[0]["us_per_step_by_category"]
    assert profs[1]["kernel_us_per_step"] == pytest.approx(sum(profs[1]["us_per_step_by_category"].values()), rel=1e-3)
    assert {(p["kernel"], p["mode"], p["batch"]) for p in points} == {
        (k, m, b) for k in ("fp16", "marlin") for m in ("eager", "graph") for b in (1, 3)
    }
    for p in points:
        assert p["tpot_ms"] > 0 and p["ttft_ms"] > 0 and p["check_rel_err"] <= bench_e2e.CHECK_TOL
        assert p["tokens_per_s"] == pytest.approx(p["batch"] / p["tpot_ms"] * 1e3)
    marlin_bytes = {p["weight_bytes"] for p in points if p["kernel"] == "marlin"}
    fp16_bytes = {p["weight_bytes"] for p in points if p["kernel"] == "fp16"}
    assert len(marlin_bytes) == len(fp16_bytes) == 1 and marlin_bytes.pop() < fp16_bytes.pop()
    sp = {(s["mode"], s["batch"]): s for s in data["speedups"]}
    assert set(sp) == {(m, b) for m in ("eager", "graph") for b in (1, 3)}
    by = {(p["kernel"], p["mode"], p["batch"]): p for p in points}
    s = sp[("graph", 3)]
    assert s["speedup"] == pytest.approx(by[("fp16", "graph", 3)]["tpot_ms"] / by[("marlin", "graph", 3)]["tpot_ms"])
    msgs = report.report(out, tmp_path)
    assert (tmp_path / "e2e.png").is_file() and "| marlin | graph | 3 |" in (tmp_path / "e2e.md").read_text()
    assert msgs == ["wrote e2e.png", "wrote e2e-profile.png", "wrote e2e.md"]
    md = (tmp_path / "e2e.md").read_text()
    assert "## Where a decode step's time goes: marlin, graph, batch 3" in md and "![e2e-profile.png]" in md
    assert (tmp_path / "e2e-profile.png").is_file()


def test_dry_run_with_inductor_pdl(tmp_path):
    # --inductor-pdl turns on inductor's programmatic dependent launch for the whole process (both
    # kernels alike; on by default where this torch has it) and says so in the meta
    import torch._inductor.config as inductor_config

    from marlin.decode import inductor_pdl_supported

    out = tmp_path / "e2e.json"
    argv = ["--dry-run", "--kernels", "fp16,marlin", "--modes", "graph", "--inductor-pdl", "--out", str(out)]
    if not inductor_pdl_supported():  # (config.patch would refuse the unknown key)
        with pytest.raises(SystemExit, match="enable_pdl"):
            bench_e2e.main(argv)
        return
    with inductor_config.patch({"triton.enable_pdl": False}):
        assert bench_e2e.main(argv) == 0
        assert inductor_config.triton.enable_pdl is True
    meta = json.loads(out.read_text())["meta"]
    assert meta["inductor_pdl"] is True and meta["complete"]
    # on by default; --no-inductor-pdl turns it off (also where the environment turned it on)
    with inductor_config.patch({"triton.enable_pdl": True}):
        assert bench_e2e.main(argv[:-3] + ["--no-inductor-pdl", "--out", str(out)]) == 0
        assert inductor_config.triton.enable_pdl is False
    assert json.loads(out.read_text())["meta"]["inductor_pdl"] is False
    with inductor_config.patch({"triton.enable_pdl": False}):
        assert bench_e2e.main(argv[:-3] + ["--out", str(out)]) == 0
    assert json.loads(out.read_text())["meta"]["inductor_pdl"] is True


def test_dry_run_with_the_2_4_kernel_after_the_dense_one(tmp_path):
    # marlin_24 runs after marlin: the dense conversion replaced the FP16 weights, so it rebuilds
    # the model from its seed, prunes it 2:4 and fuses the projections
    out = tmp_path / "e2e.json"
    assert bench_e2e.main(["--dry-run", "--kernels", "marlin_24,marlin", "--modes", "graph", "--out", str(out)]) == 0
    points = json.loads(out.read_text())["points"]
    assert [(p["kernel"], p["batch"]) for p in points] == [("marlin", 1), ("marlin", 3), ("marlin_24", 1), ("marlin_24", 3)]
    for p in points:
        assert p["graph_breaks"] == 0 and p["check_rel_err"] <= bench_e2e.CHECK_TOL
    dense, sparse = ({p["weight_bytes"] for p in points if p["kernel"] == k} for k in ("marlin", "marlin_24"))
    assert len(dense) == len(sparse) == 1 and sparse.pop() < dense.pop()


def test_speedups_and_targets():
    pts = [
        {"kernel": "fp16", "mode": "compiled", "batch": 16, "tpot_ms": 10.0},
        {"kernel": "marlin", "mode": "compiled", "batch": 16, "tpot_ms": 4.0},
        {"kernel": "marlin", "mode": "graph", "batch": 16, "tpot_ms": 4.0},  # no fp16 graph point: no speedup
        {"kernel": "marlin", "mode": "compiled", "batch": 1, "error": "x"},
    ]
    (s,) = bench_e2e.speedups(pts)
    assert (s["kernel"], s["mode"], s["batch"], s["speedup"], s["target"], s["met"], s["baseline"]) == (
        "marlin", "compiled", 16, 2.5, 2.0, True, "fp16")


@pytest.mark.parametrize("engine", ["slots", "transformers"])
def test_serving_dry_run_and_report(tmp_path, engine):
    from benchmarks import bench_e2e_serving

    out = tmp_path / "serving.json"
    assert bench_e2e_serving.main(["--dry-run", "--engine", engine, "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["meta"]["kind"] == "serving" and data["meta"]["engine"] == engine
    points = data["points"]
    assert {(p["kernel"], p["rate"]) for p in points} == {(k, r) for k in ("fp16", "marlin") for r in (50.0, None)}
    for p in points:
        assert p["ok"] == 4 and p["failed"] == 0 and p["tpot_ms_median"] > 0 and p["ttft_ms_median"] > 0
    reqs = data["requests"]
    assert len(reqs) == 16 and all(r["tokens"] == r["output_len"] for r in reqs)  # no EOS: every token generated
    assert all(p["tpot_speedup"] > 0 for p in points if p["kernel"] == "marlin")
    assert report.report(out, tmp_path)[-1] == "wrote serving.md"


def test_serving_dry_run_with_the_2_4_kernel(tmp_path):
    # after marlin the FP16 weights are gone: marlin_24 rebuilds the model from its seed
    from benchmarks import bench_e2e_serving

    out = tmp_path / "serving.json"
    assert bench_e2e_serving.main(["--dry-run", "--kernels", "fp16,marlin,marlin_24", "--out", str(out)]) == 0
    points = json.loads(out.read_text())["points"]
    assert [p["kernel"] for p in points] == ["fp16", "fp16", "marlin", "marlin", "marlin_24", "marlin_24"]
    assert all(p["ok"] == 4 and p["failed"] == 0 for p in points)
    assert all(p["tpot_speedup"] > 0 for p in points[2:])
    assert report.report(out, tmp_path)[-1] == "wrote serving.md"
    assert "| marlin_24 |" in (tmp_path / "serving.md").read_text()


def test_workload_is_reproducible():
    from benchmarks import bench_e2e_serving as S

    a = S.workload(20, 128, 64, 1024, 32000, seed=3)
    assert a == S.workload(20, 128, 64, 1024, 32000, seed=3)
    assert all(4 <= len(r["prompt"]) <= 1024 and 4 <= r["output_len"] <= 1024 for r in a)
    t = S.arrivals(50, 4.0, seed=3)
    assert t[0] == 0.0 and all(b >= a for a, b in zip(t, t[1:])) and 5 < t[-1] < 25  # ~49 gaps of 0.25 s
    assert S.arrivals(3, float("inf"), 0) == [0.0, 0.0, 0.0]


def test_fp16_fused_baseline():
    # fuse_fp16: one nn.Linear per group with the parts' weights stacked; same logits (up to the
    # GEMM's summation order), and the original layers come back.
    import torch

    from benchmarks.e2e_model import build_model, fuse_fp16

    model = build_model("tiny", None, torch.device("cpu"))
    attn = model.model.layers[0].self_attn
    q = attn.q_proj
    ids = torch.randint(0, 1000, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits.float()
        restore = fuse_fp16(model)
        assert type(attn.qkv_proj) is torch.nn.Linear and attn.qkv_proj.out_features == 256 + 2 * 128
        assert torch.equal(attn.qkv_proj.weight[:256], q.weight)
        fused = model(ids).logits.float()
        restore()
        assert attn.q_proj is q and "qkv_proj" not in attn._modules
        assert torch.equal(model(ids).logits.float(), ref)
    assert ((fused - ref).norm() / ref.norm()).item() < 1e-2


def test_speedups_over_both_baselines():
    pts = [{"kernel": k, "mode": "compiled", "batch": 1, "tpot_ms": t, "ttft_ms": 1.0, "tokens_per_s": 1e3 / t}
           for k, t in (("fp16", 10.0), ("fp16_fused", 8.0), ("marlin", 4.0))]
    sp = {(s["kernel"], s["baseline"]): s for s in bench_e2e.speedups(pts)}
    assert set(sp) == {("fp16_fused", "fp16"), ("marlin", "fp16"), ("marlin", "fp16_fused")}
    assert sp[("marlin", "fp16_fused")]["speedup"] == 2.0 and sp[("marlin", "fp16")]["met"] is True
    assert sp[("fp16_fused", "fp16")]["target"] is None  # the targets are Marlin's
    table = bench_e2e.format_table(pts, list(sp.values()), None)
    assert "marlin          compiled      1     4.000     250.0" in table and "2.50    2.00" in table
    # the markdown gives the batch-1 target's verdict over each baseline (2.5x: met over fp16, not over fused)
    from benchmarks.report_e2e import markdown

    md = markdown({"meta": {}, "points": pts, "speedups": list(sp.values())}, "no figure")
    assert "| marlin | compiled | 1 | 4.000 | 250.0 | 1.00 | 2.50 | >= 2.5: met | 2.00 | >= 2.5: missed |" in md


def test_fp16_kn_layout():
    # to_kn: every nn.Linear (the fused ones and lm_head too) as a LinearKN holding W^T [K, N];
    # the same logits up to the GEMM's summation order, and restore puts nn.Linear layers with the
    # original weights back (exact: a transpose)
    import torch

    from benchmarks.e2e_model import LinearKN, build_model, fuse_fp16, to_kn, weight_bytes

    model = build_model("tiny", None, torch.device("cpu"))
    mlp = model.model.layers[1].mlp
    w_down = mlp.down_proj.weight.clone()
    ids = torch.randint(0, 1000, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits.float()
        nbytes = weight_bytes(model)
        undo_fuse = fuse_fp16(model)
        undo_kn = to_kn(model)
        assert type(mlp.down_proj) is LinearKN and type(mlp.gate_up_proj) is LinearKN and type(model.lm_head) is LinearKN
        assert not any(type(m) is torch.nn.Linear for m in model.modules())
        assert torch.equal(mlp.down_proj.weight_kn, w_down.t()) and mlp.down_proj.weight_kn.is_contiguous()
        assert weight_bytes(model) == nbytes  # the same weights, stacked and transposed
        kn = model(ids).logits.float()
        undo_kn()
        undo_fuse()
        assert type(mlp.down_proj) is torch.nn.Linear and torch.equal(mlp.down_proj.weight, w_down)
        assert torch.equal(model(ids).logits.float(), ref)
    assert ((kn - ref).norm() / ref.norm()).item() < 1e-2


def test_speedups_over_the_faster_layout():
    # each FP16 baseline is the faster of its layouts that ran: fp16_kn beats fp16 here, fp16_fused
    # beats fp16_fused_kn; the layouts of a baseline get no speedup over it
    pts = [{"kernel": k, "mode": "compiled", "batch": 1, "tpot_ms": t, "ttft_ms": 1.0, "tokens_per_s": 1e3 / t}
           for k, t in (("fp16", 10.0), ("fp16_kn", 9.0), ("fp16_fused", 8.0), ("fp16_fused_kn", 8.5), ("marlin", 4.0))]
    sp = {(s["kernel"], s["baseline"]): s for s in bench_e2e.speedups(pts)}
    assert set(sp) == {("fp16_fused", "fp16"), ("fp16_fused_kn", "fp16"), ("marlin", "fp16"), ("marlin", "fp16_fused")}
    assert sp[("marlin", "fp16")]["speedup"] == 2.25 and sp[("marlin", "fp16")]["baseline_kernel"] == "fp16_kn"
    assert sp[("marlin", "fp16")]["met"] is False  # 2.25 < the batch-1 target of 2.5 over the faster layout
    assert sp[("marlin", "fp16_fused")]["speedup"] == 2.0 and sp[("marlin", "fp16_fused")]["baseline_kernel"] == "fp16_fused"
    assert sp[("fp16_fused_kn", "fp16")]["target"] is None
    from benchmarks.report_e2e import markdown

    md = "\n".join(markdown({"meta": {}, "points": pts, "speedups": list(sp.values())}, "no figure"))
    assert "| marlin | compiled | 1 | 4.000 | 250.0 | 1.00 | 2.25 | >= 2.5: missed | 2.00 | >= 2.5: missed |" in md
    assert "the [K, N] layout was the faster for fp16 at 1 of 1 (mode, batch) points, fp16_fused at 0 of 1" in md


def test_dry_run_with_the_kn_layouts(tmp_path):
    # fp16_kn and fp16_fused_kn run on the FP16 model and are undone before the Marlin conversion
    out = tmp_path / "e2e.json"
    argv = ["--dry-run", "--kernels", "marlin,fp16_fused_kn,fp16_kn,fp16", "--modes", "graph", "--out", str(out)]
    assert bench_e2e.main(argv) == 0
    data = json.loads(out.read_text())
    assert list(dict.fromkeys(p["kernel"] for p in data["points"])) == ["fp16", "fp16_kn", "fp16_fused_kn", "marlin"]
    for p in data["points"]:
        assert p["graph_breaks"] == 0 and p["check_rel_err"] <= bench_e2e.CHECK_TOL
    assert len({p["weight_bytes"] for p in data["points"] if p["kernel"].startswith("fp16")}) == 1
    by = {(p["kernel"], p["batch"]): p["tpot_ms"] for p in data["points"]}
    over_fp16 = [s for s in data["speedups"] if s["kernel"] == "marlin" and s["baseline"] == "fp16"]
    assert len(over_fp16) == 2
    for s in over_fp16:  # over the faster of the two layouts at its batch
        faster = min(("fp16", "fp16_kn"), key=lambda k: by[(k, s["batch"])])
        assert s["baseline_kernel"] == faster and s["speedup"] == pytest.approx(by[(faster, s["batch"])] / by[("marlin", s["batch"])])
    assert report.report(out, tmp_path)[-1] == "wrote e2e.md"
    assert "| fp16_fused_kn | graph | 3 |" in (tmp_path / "e2e.md").read_text()


def test_decode_step_reads_the_static_cache():
    # The step must attend to the prompt in the static cache: transformers up to 5.1x names the
    # forward's cache argument past_key_values, 5.2x names it cache, and a wrong name is silently
    # ignored (a fresh DynamicCache per step: attention over the new token only, no cache read).
    import torch

    from benchmarks.e2e_model import DecodeStep, build_model, cache_kwarg

    model = build_model("tiny", None, torch.device("cpu")).float()
    step = DecodeStep(model, 2, 8, 4, torch.device("cpu"), seed=3)
    step.prefill()
    layers = [layer for layer in step.cache.layers if getattr(layer, "is_initialized", False)]
    assert len(layers) == model.config.num_hidden_layers  # the prefill filled the static cache
    step.reset(step.prompt_len)
    with torch.no_grad():
        before = step.eager_call()().clone()
        for layer in layers:  # other cached values: a step that reads the cache must change
            layer.keys.normal_()
            layer.values.normal_()
        step.reset(step.prompt_len)
        after = step.eager_call()()
    assert (before - after).abs().max() > 1e-3


def test_cache_kwarg_follows_the_forward_signature():
    from benchmarks.e2e_model import cache_kwarg

    class Old:
        def forward(self, input_ids=None, past_key_values=None, **kwargs): ...

    class New:
        def forward(self, input_ids=None, cache=None, **kwargs): ...

    class Neither:
        def forward(self, input_ids=None, **kwargs): ...

    assert cache_kwarg(Old()) == "past_key_values" and cache_kwarg(New()) == "cache"
    with pytest.raises(TypeError, match="neither"):
        cache_kwarg(Neither())


@pytest.mark.parametrize("kernel", ["fp16", "marlin"])
@pytest.mark.parametrize("compiled", [False, True])
def test_slot_server_generates_what_generate_does(kernel, compiled):
    # The slots engine (benchmarks/serving_engine.py): 6 requests of different lengths through 3
    # rows, arriving together and later (rows freed and reused, several (B, Lb) buckets, rows of
    # different lengths in one step): each request's tokens are the model's own greedy generate().
    # Compiled: decoder layers traced with fullgraph (backend "eager": dynamo's trace, no C++
    # toolchain), as the benchmark compiles them with inductor.
    import torch

    from benchmarks.e2e_model import build_model, compile_layers, to_marlin
    from benchmarks.serving_engine import SlotServer

    model = build_model("tiny", None, torch.device("cpu"))  # fp16: the Marlin layers' compute dtype
    if kernel == "marlin":
        to_marlin(model, fuse=True)
    else:
        model.float()
    g = torch.Generator().manual_seed(5)
    lens = [(5, 4), (9, 7), (3, 6), (12, 5), (7, 9), (20, 3)]
    reqs = [{"prompt": torch.randint(0, 1000, (p,), generator=g).tolist(), "output_len": o} for p, o in lens]
    torch._dynamo.reset()
    undo = compile_layers(model, "eager") if compiled else (lambda: None)
    try:
        server = SlotServer(model, slots=3, max_len=32, kv_bucket=8)
        res = server.serve(reqs, [0.0, 0.0, 0.0, 0.02, 0.02, 0.05], collect_tokens=True)
    finally:
        undo()
        torch._dynamo.reset()
    for r, q in zip(res, reqs):
        ref = model.generate(torch.tensor([q["prompt"]]), max_new_tokens=q["output_len"], min_new_tokens=q["output_len"],
                             do_sample=False, pad_token_id=0)[0, len(q["prompt"]):].tolist()
        assert r["ids"] == ref and r["tokens"] == q["output_len"] and r["ttft_s"] >= 0 and r["tpot_s"] > 0
    with pytest.raises(ValueError, match="max_len 32"):
        server.serve([{"prompt": [1] * 30, "output_len": 4}], [0.0])


@requires_cuda
@pytest.mark.parametrize("kernel", [
    # open (H100, 2026-11-26): the fp32 model's tokens differ from its generate() on the GPU (they
    # match on the CPU, and the fp16 Marlin model matches on the GPU); not yet told apart whether
    # the engine or the reference's different attention path (no mask, is_causal) is the cause
    pytest.param("fp16", marks=pytest.mark.xfail(reason="fp32 model on the GPU: tokens differ from generate(), "
                                                       "cause not identified", strict=False)),
    "marlin",
])
def test_slot_server_graphs_generate_what_generate_does(kernel):
    # On a GPU the server replays CUDA graphs: decode steps per (B, Lb) bucket and prefills per
    # padded prompt length (the prompt padded at its end to 16 / 32 tokens here). Each request's
    # tokens must still be the model's own greedy generate(); and every prefill length was captured.
    import torch

    from benchmarks.e2e_model import build_model, to_marlin
    from benchmarks.serving_engine import SlotServer

    model = build_model("tiny", None, torch.device("cuda"))  # fp16: the Marlin layers' compute dtype
    if kernel == "marlin":
        to_marlin(model, fuse=True)
    else:
        model.float()  # fp32: no near-ties between padded and unpadded GEMM shapes
    g = torch.Generator().manual_seed(7)
    lens = [(5, 4), (17, 6), (3, 6), (12, 5), (7, 9), (20, 3)]
    reqs = [{"prompt": torch.randint(0, 1000, (n,), generator=g).tolist(), "output_len": o} for n, o in lens]
    server = SlotServer(model, slots=3, max_len=32, kv_bucket=8)
    server.capture_all()
    assert server.prefill_graph_error is None and sorted(server.prefill_graphs) == server.prefill_lens == [16, 32]
    res = server.serve(reqs, [0.0, 0.0, 0.0, 0.02, 0.02, 0.05], collect_tokens=True)
    for r, q in zip(res, reqs):
        ref = model.generate(torch.tensor([q["prompt"]], device="cuda"), max_new_tokens=q["output_len"],
                             min_new_tokens=q["output_len"], do_sample=False, pad_token_id=0)[0, len(q["prompt"]):]
        assert r["ids"] == ref.tolist(), (q, r["ids"], ref.tolist())


def test_slot_server_buckets():
    import torch

    from benchmarks.e2e_model import build_model
    from benchmarks.serving_engine import SlotServer

    server = SlotServer(build_model("tiny", None, torch.device("cpu")), slots=6, max_len=20, kv_bucket=8)
    assert server.max_len == 24
    assert server.buckets() == [(b, lb) for b in (1, 2, 4, 6) for lb in (8, 16, 24)]
    assert server.prefill_lens == [16, 24]  # prompts padded to powers of two from 16, capped at the row length
    assert server.graph_count() == 0  # CPU: no graphs
    small = SlotServer(build_model("tiny", None, torch.device("cpu")), slots=4, max_len=8, kv_bucket=8)
    assert small.buckets() == [(1, 8), (2, 8), (4, 8)] and small.prefill_lens == [8]


def test_dry_run_layer_scope(tmp_path):
    # --compile-scope layer: each decoder layer traced on its own (one graph per layer and batch
    # shape, no breaks), the step checked against the eager forward (eager also for the layers)
    out = tmp_path / "e2e.json"
    assert bench_e2e.main(["--dry-run", "--kernels", "fp16", "--modes", "compiled", "--compile-scope", "layer",
                           "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["meta"]["compile_scope"] == "layer"
    for p in data["points"]:
        assert p["compile_scope"] == "layer" and p["graph_breaks"] == 0 and p["new_graphs"] == 2  # 2 layers
        assert p["check_rel_err"] <= bench_e2e.CHECK_TOL


def test_serving_fused_baseline(tmp_path):
    # --kernels fp16,fp16_fused,marlin: the stacked FP16 baseline served too (and undone before
    # Marlin converts the model); Marlin's TPOT speedup over each baseline per rate; the report
    # draws and tabulates all three
    from benchmarks import bench_e2e_serving

    out = tmp_path / "serving.json"
    assert bench_e2e_serving.main(["--dry-run", "--kernels", "marlin,fp16_fused,fp16", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [p["kernel"] for p in data["points"]] == ["fp16"] * 2 + ["fp16_fused"] * 2 + ["marlin"] * 2
    by = {p["kernel"]: p for p in data["points"] if p["rate"] is None}
    m = by["marlin"]
    assert m["tpot_speedup"] == pytest.approx(by["fp16"]["tpot_ms_median"] / m["tpot_ms_median"])
    assert m["tpot_speedup_over_fused"] == pytest.approx(by["fp16_fused"]["tpot_ms_median"] / m["tpot_ms_median"])
    assert all(p["mean_rows"] > 0 and p["mean_kv_len"] > 0 for p in data["points"])
    assert report.report(out, tmp_path)[-1] == "wrote serving.md"
    assert "| fp16_fused |" in (tmp_path / "serving.md").read_text()


def test_slot_server_compiles_once_for_all_layers():
    # compile_layers + SlotCache: the layer number is traced, so the number of compiled graphs does
    # not grow with the depth (4: layer 0, the layer number made dynamic, then the cache length and
    # the batch); a per-layer compile would take 4 per layer here
    import torch
    from torch._dynamo.utils import counters

    from benchmarks.e2e_model import build_model, compile_layers
    from benchmarks.serving_engine import SlotServer

    model = build_model("tiny", 4, torch.device("cpu")).float()
    undo = compile_layers(model, "eager")
    try:
        counters.clear()
        server = SlotServer(model, slots=4, max_len=32, kv_bucket=8, use_graphs=False)
        with torch.no_grad():
            for b, lb in server.buckets():
                server.step_fn(*server._args(b, lb))
        assert counters["stats"]["unique_graphs"] <= 4 and not counters["graph_break"]
    finally:
        undo()


def test_slot_step_matches_the_static_cache_step():
    # bench_e2e --cache slots: same prompts, same first decode step, same logits as the step on
    # transformers' StaticCache (the cache layout and mask differ, the attention does not), and
    # consecutive steps keep agreeing (positions advance on the device)
    import torch

    from benchmarks.e2e_model import DecodeStep, build_model
    from benchmarks.e2e_slots import SlotStep

    model = build_model("tiny", None, torch.device("cpu")).float()
    a = DecodeStep(model, 3, 8, 4, torch.device("cpu"), seed=2)
    b = SlotStep(model, 3, 8, 4, torch.device("cpu"), seed=2)
    assert torch.equal(a.prompt, b.prompt) and torch.equal(a.ids, b.ids)
    a.prefill()
    b.prefill()
    with torch.no_grad():
        for i in range(3):
            a.reset(8 + i)
            a.pos.fill_(8 + i)  # DecodeStep's rotary position stays at the prompt length unless told
            ra = a.eager_call()().float()
            ids = b.ids.clone()
            rb = b.eager_call()().float()  # advances b's positions and feeds its tokens back
            a.ids.copy_(b.ids)  # the static-cache step takes the same next tokens
            assert torch.equal(b.pos, torch.full((3,), 9 + i))
            assert ((ra - rb).norm() / ra.norm()).item() < 1e-5, i
            assert not torch.equal(ids, b.ids)  # tokens fed back


def test_report_takes_the_profiler_step_annotation_out_of_older_profiles():
    # profiles of 2026-11-28 (d846586) counted "ProfilerStep*" (one per step, the whole step long) in "other"
    from benchmarks.report_e2e import _profiles

    prof = {"kernel": "marlin", "batch": 1, "us_per_step_by_category": {"other": 1002.0, "marlin GEMM": 900.0},
            "calls_per_step_by_category": {"other": 2.0, "marlin GEMM": 4.0}, "kernel_us_per_step": 1902.0,
            "idle_us_per_step": -900.0,
            "top_kernels": [{"name": "ProfilerStep*", "us_per_step": 1000.0, "calls_per_step": 1.0},
                            {"name": "marlin_kernel", "us_per_step": 900.0, "calls_per_step": 4.0}]}
    (fixed,) = _profiles({"profiles": [prof]})
    assert fixed["us_per_step_by_category"] == {"marlin GEMM": 900.0, "other": 2.0}
    assert fixed["calls_per_step_by_category"]["other"] == 1.0
    assert fixed["kernel_us_per_step"] == 902.0 and fixed["idle_us_per_step"] == 100.0
    assert [k["name"] for k in fixed["top_kernels"]] == ["marlin_kernel"]
    assert prof["kernel_us_per_step"] == 1902.0  # the results' own dict is left as read
    clean = {k: v for k, v in prof.items() if k != "top_kernels"}
    assert _profiles({"profiles": [clean]}) == [clean]
