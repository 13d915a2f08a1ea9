"""docs/structure.md's module table is the one scripts/tools/structure.py makes from the modules'
docstrings, and every module has a docstring to make its row from."""

import os

import pytest

from conftest import REPO
from scripts.tools import structure


def test_every_module_says_what_it_owns():
    assert not structure.undocumented(), (
        f"give these modules a docstring saying what they own: {structure.undocumented()}")


def test_the_module_table_in_docs_structure_is_generated_from_the_docstrings():
    with open(os.path.join(REPO, structure.PAGE)) as f:
        page = f.read()
    assert structure.table() in page, (
        "docs/structure.md's module table is out of date: run "
        "python scripts/tools/structure.py --write")
    rows = structure.table().count("\n| `")
    assert rows > 100 and "| `hetjax.core.plan` | The Plan: the complete training layout, " \
        "as plain data. |" in page


def test_the_table_names_every_module_and_follows_a_changed_docstring(tmp_path):
    """A module added, or a docstring changed, changes the table (so the test above fails until
    the page is regenerated)."""
    import shutil

    def only_modules(folder, names):  # the .py files and the folders holding them
        return [n for n in names if n == "__pycache__" or not (
            n.endswith(".py") or os.path.isdir(os.path.join(folder, n)))]

    for top in ("hetjax", "scripts"):  # hetjax/layers and hetjax/parallel: copied, not linked
        shutil.copytree(os.path.join(REPO, top), tmp_path / top, ignore=only_modules)
    before = structure.table(str(tmp_path))
    (tmp_path / "hetjax" / "core" / "toy.py").write_text('"""A toy: owns nothing. Really."""\n')
    after = structure.table(str(tmp_path))
    assert after != before and "| `hetjax.core.toy` | A toy: owns nothing. |" in after
    (tmp_path / "hetjax" / "core" / "toy.py").write_text("x = 1\n")
    assert structure.undocumented(str(tmp_path)) == ["hetjax.core.toy"]


@pytest.mark.parametrize("doc,sentence", [
    ("Hooks: e.g. a timer. Then more.", "Hooks: e.g. a timer."),
    ("One line\nacross two. Second.\n\nAnother paragraph.", "One line across two."),
    ("No period at all", "No period at all"),
    ("A " + "long clause, " * 20 + "end.", "A " + "long clause, " * 11 + "long clause ..."),
])
def test_a_row_is_the_first_sentence(doc, sentence):
    assert structure.first_sentence(doc) == sentence
