"""benchmarks/accuracy.py on the CPU without the real model: its helpers and the results table."""

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

pytest.importorskip("transformers")

from benchmarks import accuracy as A  # noqa: E402

from quantize_fixtures import make_model_dir  # noqa: E402


def test_points_merge_per_method_group_size_and_settings():
    points = [{"method": "rtn", "group_size": 64, "ppl": 9.0}, {"method": "rtn", "group_size": -1, "ppl": 8.0}]
    merged = A.merge_point(points, {"method": "rtn", "group_size": 64, "ppl": 7.0})
    assert sorted((p["group_size"], p["ppl"]) for p in merged) == [(-1, 8.0), (64, 7.0)]
    act = {"method": "gptq", "group_size": 64, "ppl": 6.0, "act_order": True, "nsamples": 32}
    merged = A.merge_point(A.merge_point(merged, dict(act, act_order=False)), act)
    assert len(merged) == 4


def test_points_of_another_calibration_seed_are_kept_and_labelled():
    """A second seed's run adds its points beside the first's (it used to replace them); points
    written before the seed was recorded count as seed 0, the default of every run until then."""
    old = {"method": "gptq_variant", "group_size": -1, "ppl": 36.0, "act_order": True, "nsamples": 256}
    seed0 = dict(old, seed=0, ppl=35.8)
    seed1 = dict(old, seed=1, ppl=36.1)
    points = A.merge_point(A.merge_point([old], seed1), seed0)
    assert sorted(p["ppl"] for p in points) == [35.8, 36.1]  # seed 0 replaced the unrecorded point
    rtn = {"method": "rtn", "group_size": -1, "ppl": 60.0}
    assert len(A.merge_point(A.merge_point(points, rtn), dict(rtn, seed=3))) == 3  # rtn draws no samples
    doc = {"meta": {"nsamples": 256, "seed": 0}, "points": [{"method": "fp16", "group_size": None, "ppl": 33.0}] + points}
    table = A.markdown_table(doc)
    assert "| gptq_variant (act-order) | 35.800 (+8.5%) |" in table
    assert "| gptq_variant (act-order, seed 1) | 36.100 (+9.4%) |" in table


def test_markdown_table_gives_the_increase_over_fp16():
    doc = {
        "points": [
            {"method": "fp16", "group_size": None, "ppl": 10.0},
            {"method": "rtn", "group_size": 64, "ppl": 12.0},
            {"method": "gptq_variant", "group_size": 64, "ppl": 10.5},
            {"method": "gptq_variant", "group_size": -1, "ppl": 11.0},
        ]
    }
    doc["meta"] = {"nsamples": 32}
    for p in doc["points"][1:]:
        p.update(act_order=False, nsamples=32)
    doc["points"].append({"method": "gptq_variant", "group_size": 64, "ppl": 10.2, "act_order": True, "nsamples": 128})
    table = A.markdown_table(doc).splitlines()
    assert table[0] == "| method | g64 | per column |"
    assert "| rtn | 12.000 (+20.0%) |  |" in table
    assert "| gptq_variant | 10.500 (+5.0%) | 11.000 (+10.0%) |" in table
    assert table[-1] == "| gptq_variant (act-order, 128 samples) | 10.200 (+2.0%) |  |"


def test_fixed_length_calibration_matches_the_variable_mean():
    class Args:
        nsamples, seqlen_range, seed = 8, (32, 512), 0

    var = A.calibration(None, Args, varlen=True)
    fixed = A.calibration(None, Args, varlen=False)
    assert (var.min_len, var.max_len) == (32, 512) and fixed.min_len == fixed.max_len == 272


def test_apply_rtn_rounds_every_block_linear(tmp_path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(make_model_dir(tmp_path / "m"))
    before = model.model.layers[0].mlp.up_proj.weight.clone()
    done, kept = A.apply_rtn(model, 64)
    assert done == 14 and kept == []
    after = model.model.layers[0].mlp.up_proj.weight
    assert not torch.equal(before, after)
    groups = after.reshape(-1, 64)  # rows of nn.Linear's weight, 64 inputs per group
    assert max(g.unique().numel() for g in groups[:200]) <= 16  # at most 16 levels per group


def test_format_points_are_kept_apart_and_labelled():
    base = {"method": "gptq_variant", "group_size": 64, "ppl": 10.5, "act_order": False, "nsamples": 32}
    asym = dict(base, sym=False, ppl=10.3)
    sparse = dict(base, group_size=-1, sparsity="2:4", any_shape=True, ppl=30.0)
    points = A.merge_point(A.merge_point(A.merge_point([], base), asym), sparse)
    assert len(points) == 3  # a format is part of a point's identity
    assert A.merge_point(points, dict(asym, ppl=10.0))[-1]["ppl"] == 10.0 and len(A.merge_point(points, asym)) == 3
    doc = {"meta": {"nsamples": 32}, "points": [{"method": "fp16", "group_size": None, "ppl": 10.0}] + points}
    table = A.markdown_table(doc)
    assert "| gptq_variant (asym) | 10.300 (+3.0%) |  |" in table
    assert "| gptq_variant (2:4 sparse, incl. shapes the kernel refuses) |  | 30.000 (+200.0%) |" in table


def test_rotation_points_are_kept_apart_and_labelled():
    """Points written as "rotate": true (when --rotate rotated the value heads too) and
    "residual+heads" are one kind; "residual", "residual+down" (today's --rotate) and no rotation
    are three others."""
    base = {"method": "gptq_variant", "group_size": -1, "ppl": 10.5, "act_order": False, "nsamples": 32}
    old = dict(base, rotate=True, ppl=10.4)
    residual = dict(base, rotate="residual", ppl=10.2)
    down = dict(base, rotate="residual+down", ppl=10.1)
    points = []
    for p in (base, old, residual, down):
        points = A.merge_point(points, p)
    assert len(points) == 4
    assert len(A.merge_point(points, dict(base, rotate="residual+heads", ppl=10.3))) == 4  # replaces `old`
    doc = {"meta": {"nsamples": 32}, "points": [{"method": "fp16", "group_size": None, "ppl": 10.0}] + points}
    table = A.markdown_table(doc)
    assert "| gptq_variant (rotated) | 10.100 (+1.0%) |" in table
    assert "| gptq_variant (rotated residual only) | 10.200 (+2.0%) |" in table
    assert "| gptq_variant (rotated with value heads) | 10.400 (+4.0%) |" in table
    assert "| gptq_variant | 10.500 (+5.0%) |" in table


def test_apply_rtn_in_other_formats(tmp_path):
    import transformers

    from marlin import sparse

    model = transformers.AutoModelForCausalLM.from_pretrained(make_model_dir(tmp_path / "m"))
    asym = A.apply_rtn(model, 64, {"sym": False})
    assert asym == (14, [])
    groups = model.model.layers[0].mlp.up_proj.weight.reshape(-1, 64)
    assert max(g.unique().numel() for g in groups[:200]) <= 16
    assert any(g.min() != -g.max() for g in groups[:200])  # zero points: ranges are not symmetric
    model = transformers.AutoModelForCausalLM.from_pretrained(make_model_dir(tmp_path / "m2"))
    assert A.apply_rtn(model, -1, {"sparsity": "2:4"}) == (14, [])
    w = model.model.layers[1].self_attn.o_proj.weight
    assert sparse.violations_2_4(w.detach().t()).numel() == 0 and float((w == 0).float().mean()) >= 0.5
