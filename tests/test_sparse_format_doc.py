"""docs/FORMAT.md section 7 (2:4-sparse weights) against marlin.sparse: the worked example is run
and its printed output must equal the doc's output block, so that doc and code cannot drift."""

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
