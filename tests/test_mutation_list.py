"""scripts/mutation_check.py's list stays in step with the code: ``--list`` runs and every
mutation's old text occurs exactly once in the current tree (the script itself is too slow for
CI; it is run by hand, see its docstring)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import mutation_check  # noqa: E402


def test_every_mutation_applies_exactly_once_to_the_current_tree():
    assert len(mutation_check.MUTATIONS) >= 20
    assert mutation_check.check_list() == []
    for m in mutation_check.MUTATIONS:
        text = (REPO / m.file).read_text()
        assert text.count(m.old) == 1, m.name
        assert text.replace(m.old, m.new) != text, m.name


def test_check_list_reports_a_moved_text(tmp_path):
    m = mutation_check.Mutation("moved", "a.py", "x = 1", "x = 2", ("t.py",))
    (tmp_path / "a.py").write_text("x = 1\nx = 1\n")
    (tmp_path / "t.py").write_text("")
    assert mutation_check.check_list([m], tmp_path) == [
        "moved: old text found 2 times in a.py (the code moved: update the mutation)"
    ]


def test_list_option_runs():
    p = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "mutation_check.py"), "--list"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert len(lines) == len(mutation_check.MUTATIONS)
    assert [ln.split()[0] for ln in lines] == [m.name for m in mutation_check.MUTATIONS]
