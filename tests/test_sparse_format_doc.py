"""docs/FORMAT.md section 7 (2:4-sparse weights) against marlin.sparse: the worked examples (the
layout, and zero points) are run and their printed output must equal the doc's output blocks, so
that doc and code cannot drift."""

import contextlib
import io
import re
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "FORMAT.md"


def section_7() -> str:
    text = DOC.read_text()
    start = text.index("## 7. 2:4-sparse weights")
    nxt = text.find("\n## ", start + 1)
    return text[start: nxt if nxt >= 0 else len(text)]


def test_worked_example_output_matches_the_doc():
    sec = section_7()
    code = re.search(r"```python\n(.*?)```", sec, re.S).group(1)
    expected = re.search(r"Output:\n\n```\n(.*?)```", sec, re.S).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "FORMAT.md section 7", "exec"), {})
    assert out.getvalue() == expected
    # the hand-decoded halves quoted in the prose are the printed word's halves
    assert "lane  0: 0xed9c9c84" in expected and "`0x9c84`" in sec and "`0xed9c`" in sec


def test_zero_point_example_output_matches_the_doc():
    """The second example (zero points): its printed output must equal the doc's."""
    sec = section_7()
    code = re.findall(r"```python\n(.*?)```", sec, re.S)[1]
    expected = re.findall(r"Output:\n\n```\n(.*?)```", sec, re.S)[1]
    assert "sym=False" in code
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "FORMAT.md section 7, zero points", "exec"), {})
    assert out.getvalue() == expected
    assert "stored u [0, 15, 7, 4]" in expected and "`u = z = 4`" in sec
