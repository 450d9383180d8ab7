"""scripts/remeasure.sh re-measures the committed results with the arguments they were made with:
each step's benchmark arguments (less --out) equal the argv recorded in the committed H200 file's
meta, so a re-measured file is comparable with the one it replaces."""

import json
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "remeasure.sh"
RESULTS = ROOT / "benchmarks" / "results"


def step_args(step: str) -> list[str]:
    """The benchmark arguments of one step of the script, its variables substituted, --out dropped."""
    text = SCRIPT.read_text().replace("\\\n", " ")
    variables = dict(re.findall(r'^(\w+_kernels)="([^"]*)"', text, re.M))
    line = next(l for l in text.splitlines() if re.match(rf"\s*{re.escape(step)}\) ", l))
    words = shlex.split(re.sub(r'"\$(\w+_kernels)"', lambda m: variables[m.group(1)], line))
    words = words[words.index("-m") + 2:]  # after "-m benchmarks.X"
    words = words[:words.index(";;")] if ";;" in words else words
    out = words.index("--out")
    return words[:out] + words[out + 2:]


def recorded_args(name: str) -> list[str]:
    argv = json.loads((RESULTS / name).read_text())["meta"]["argv"]
    out = argv.index("--out")
    return argv[:out] + argv[out + 2:]


@pytest.mark.parametrize("step, name", [("full", "h200.json"), ("formats", "h200-formats.json"), ("layers", "h200-layers.json"),
                                        ("e2e", "h200-e2e.json"), ("serving", "h200-serving.json")])
def test_steps_repeat_the_committed_arguments(step, name):
    assert step_args(step) == recorded_args(name)


def test_a_changed_argument_would_show():
    assert step_args("full") != recorded_args("h200-formats.json")
