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
