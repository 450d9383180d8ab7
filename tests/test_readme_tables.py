"""The README's result tables are the committed results files' (benchmarks/readme_tables.py): a
re-measured file whose table the README did not follow, or a number edited by hand, fails here."""

from pathlib import Path

from benchmarks import readme_tables as RT

README = Path(__file__).resolve().parent.parent / "README.md"


def test_every_table_has_its_files():
    have = [files for files, _ in RT.tables()]
    assert len(have) == len(RT.TABLES), f"results files missing for some tables: {have}"


def test_readme_tables_match_the_results_files():
    problems = RT.check(README.read_text())
    assert not problems, "\n".join(problems) + "\n(python -m benchmarks.readme_tables prints the tables)"


def test_an_edited_number_is_caught():
    text = README.read_text()
    for _, table in RT.tables():
        row = table[2]
        cells = row.split("|")
        cells[2] = cells[2].replace(cells[2].strip(), cells[2].strip() + "0", 1)  # 2.91x -> 2.91x0
        edited = text.replace(row, "|".join(cells), 1)
        assert edited != text
        assert len(RT.check(edited)) == 1, row


def test_a_missing_table_is_caught():
    text = README.read_text()
    table = RT.tables()[-1][1]
    edited = text.replace("\n".join(table[2:]) + "\n", "")
    assert edited != text
    assert any("does not hold" in p for p in RT.check(edited))
