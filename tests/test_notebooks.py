"""The notebooks run top to bottom in a fresh kernel (nbclient, CPU, simulated devices set by
their first cell) and are stored without outputs."""

import json
import os

import pytest

from conftest import REPO

NOTEBOOKS = ("quickstart.ipynb", "planner.ipynb")


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_stored_without_outputs(name):
    with open(os.path.join(REPO, "notebooks", name)) as f:
        nb = json.load(f)
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code and all(c["outputs"] == [] and c["execution_count"] is None for c in code)


def _code_cells(name):
    with open(os.path.join(REPO, "notebooks", name)) as f:
        return ["".join(c["source"]) for c in json.load(f)["cells"] if c["cell_type"] == "code"]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_installs_itself_on_colab_and_needs_no_path_tricks(name):
    """The first cell installs hetjax only where it does not import (Colab); nothing reaches
    into the checkout through sys.path."""
    code = _code_cells(name)
    assert 'importlib.util.find_spec("hetjax") is None' in code[0] and '"pip", "install"' in code[0]
    assert not any("sys.path" in c for c in code)


def test_quickstart_checks_its_devices_and_trains_on_real_text():
    """1 GPU, a TPU or 8 simulated CPU devices: the layout follows what JAX sees; the data is
    the default corpus (Python's own sources), not synthetic tokens."""
    code = "\n".join(_code_cells("quickstart.ipynb"))
    assert 'jax.config.update("jax_num_cpu_devices", 8)' in code and "jax.devices()" in code
    assert 'platform == "cpu"' in code and "*layout" in code
    assert "synthetic" not in code and "data.source" not in code


@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_in_a_fresh_kernel(name, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    # A fresh kernel as a user starts one: no device count forced from outside (the first
    # cell sets it), this checkout importable.
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.setenv("PYTHONPATH", REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    nb = nbformat.read(os.path.join(REPO, "notebooks", name), as_version=4)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": os.path.join(REPO, "notebooks")}}
                            ).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert sum("image/png" in o.get("data", {}) for o in outputs) >= 2  # plan / loss figures


def readme_snippet() -> str:
    """The README's Python snippet, as written."""
    with open(os.path.join(REPO, "README.md")) as f:
        text = f.read()
    return text.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.slow
def test_the_readme_snippet_runs_as_written_in_a_fresh_kernel(monkeypatch, tmp_path):
    """A fresh kernel is a fresh Python process with no XLA_FLAGS: the snippet gets its
    simulated devices itself, trains, and its history and parameters are there."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.setenv("PYTHONPATH", REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    os.symlink(os.path.join(REPO, "configs"), tmp_path / "configs")  # its relative paths
    snippet = readme_snippet()
    check = ("assert summary.history.columns()['step'][-1] == 50\n"
             "assert 'layers' in trainer.params\n")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(snippet),
                                         nbformat.v4.new_code_cell(check)])
    nbclient.NotebookClient(nb, timeout=900, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for c in nb.cells for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
