"""benchmarks/plan_table.py: docs/memory.md's table is what the planner gives for the shipped Llama-3 configs, and a
stale table is refused by --check and rewritten otherwise."""

from tests.helpers import REPOSITORY, load_script


table = load_script(REPOSITORY / "benchmarks" / "plan_table.py")


def test_the_page_holds_the_planners_table(capsys):
    """If this fails: `python benchmarks/plan_table.py` (the planner or a config changed, or the table was edited)."""
    assert table.main(["--check"]) == 0, capsys.readouterr().err


def test_a_stale_table_fails_the_check_and_is_rewritten(tmp_path, capsys):
    original = table.PAGE.read_text()
    stale = tmp_path / "memory.md"
    edited = original.replace("| llama3-8b | V2 |", "| llama3-8b | V2 (edited) |", 1)
    assert edited != original
    stale.write_text(edited)
    assert table.main(["--check", "--page", str(stale)]) == 1
    assert "plan_table.py" in capsys.readouterr().err
    assert stale.read_text() == edited
    assert table.main(["--page", str(stale)]) == 0
    assert stale.read_text() == original
