"""scripts/ab_csrc.sh and benchmarks/ab_compare.py: the A/B of a kernel change (CPU: the comparison
on synthetic runs, the script's syntax and its default bench_gemm arguments)."""

import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from benchmarks import ab_compare, bench_gemm

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "ab_csrc.sh"


def _write(outdir: Path, tree: str, rnd: int, times: dict):
    points = [{"shape": s, "M": m, "kernel": k, "time_us": t} for (k, s, m), t in times.items()]
    (outdir / f"ab_{tree}_{rnd}.json").write_text(json.dumps({"meta": {}, "points": points}))


def test_ratios_take_each_trees_fastest_round(tmp_path):
    _write(tmp_path, "base", 1, {("g128", "a", 1): 10.0, ("g128", "b", 1): 20.0, ("g128", "c", 1): 30.0})
    _write(tmp_path, "base", 2, {("g128", "a", 1): 12.0, ("g128", "b", 1): 19.0, ("g128", "c", 1): 31.0})
    _write(tmp_path, "new", 1, {("g128", "a", 1): 9.0, ("g128", "b", 1): 40.0, ("g128", "c", 1): 30.0})
    _write(tmp_path, "new", 2, {("g128", "a", 1): 9.5, ("g128", "b", 1): 19.0, ("g128", "c", 1): None})
    (tmp_path / "ab_new_1.log").write_text("not a result")
    rat = ab_compare.ratios(ab_compare.load(tmp_path))
    assert rat == {("g128", 1): {"a": 0.9, "b": 1.0, "c": 1.0}}
    text = ab_compare.table(rat, per_layer=True)
    assert "| g128 | 1 | 3 | 1.000 | 0.900 (a) | 1.000 (b) |" in text and "|  |  | a | 0.900 |" in text


def test_points_of_one_tree_only_are_left_out(tmp_path, capsys):
    _write(tmp_path, "base", 1, {("g128", "a", 1): 10.0})
    _write(tmp_path, "new", 1, {("g32", "a", 1): 10.0})
    assert ab_compare.main([str(tmp_path)]) == 1
    assert "no point was timed in both trees" in capsys.readouterr().err


def test_an_empty_directory_says_what_it_looked_for(tmp_path):
    with pytest.raises(SystemExit, match="no ab_base_<r>.json"):
        ab_compare.load(tmp_path)


def test_script_parses_and_its_default_points_are_bench_gemm_arguments():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    text = SCRIPT.read_text()
    default = re.search(r"bench_args=\((--shapes.*?)\)\n", text, re.S).group(1)
    args = bench_gemm.parse_args(shlex.split(default) + ["--retime-spread", "0"])
    mode, shapes, ms, kernels = bench_gemm.resolve_plan(args, sms=132)  # unknown names would raise
    assert len(shapes) == 9 and ms == [1, 2, 4, 8, 16] and "marlin_g128" in kernels
    out = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True)  # no arguments: the usage
    assert out.returncode == 2 and "git archive" in out.stdout
