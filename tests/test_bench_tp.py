"""benchmarks/bench_tp.py runs end to end on the CPU (tiny shape, one process) and writes its results."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_tp


def test_dry_run_writes_both_kinds(tmp_path, monkeypatch, capsys):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    out = tmp_path / "tp.json"
    assert bench_tp.main(["--dry-run", "--batches", "1,2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["meta"]["world_size"] == 1 and result["meta"]["shape"]["layers"] == 2
    runs = {r["kind"]: r for r in result["runs"]}
    assert set(runs) == {"fp16", "marlin"}
    for run in runs.values():
        assert [p["batch"] for p in run["points"]] == [1, 2]
        assert all(p["tokens_per_s"] > 0 and p["graph"] is False for p in run["points"])
    # 4-bit weights are about a quarter of the FP16 bytes (plus the group-128 scales)
    ratio = runs["marlin"]["weight_bytes_per_rank"] / runs["fp16"]["weight_bytes_per_rank"]
    assert 0.25 < ratio < 0.27
    assert "marlin / fp16" in capsys.readouterr().out


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
