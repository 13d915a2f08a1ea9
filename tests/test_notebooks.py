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


@pytest.mark.heavy
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
