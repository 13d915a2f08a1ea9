"""Installing hetjax installs one top-level package, `hetjax`: the repository's `layers/` and
`parallel/` folders become `hetjax.layers` and `hetjax.parallel` (the links hetjax/layers and
hetjax/parallel point at them; the build copies the files), and no module named `layers`,
`parallel`, `configs`, `scripts` or `tests` lands beside it in site-packages.

The wheel is built from a copy of the files the build reads (so nothing is written into the
checkout) and installed, without its dependencies, into an empty directory."""

import glob
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

from conftest import REPO

# What the build reads: the project metadata and the package's sources.
BUILD_INPUTS = ("pyproject.toml", "setup.cfg", "README.md", "hetjax", "layers", "parallel")


@pytest.mark.slow
def test_installing_hetjax_puts_only_hetjax_at_the_top_level(tmp_path):
    """About 15 s: a wheel build and an install into an empty target."""
    src = tmp_path / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in BUILD_INPUTS:
        path = os.path.join(REPO, name)
        if os.path.isdir(path):  # hetjax/layers, hetjax/parallel stay links, as in the repo
            shutil.copytree(path, src / name, symlinks=True, ignore=ignore)
        else:
            shutil.copy(path, src / name)
    pip = [sys.executable, "-m", "pip"]
    build = subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                            str(tmp_path / "dist"), str(src)],
                           capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-3000:]
    (wheel,) = glob.glob(str(tmp_path / "dist" / "*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"hetjax"}, sorted(top)
    assert {"hetjax/layers/model.py", "hetjax/parallel/mpmd.py", "hetjax/core/plan.py",
            "hetjax/config/fields.py"} <= set(names)

    site = tmp_path / "site"  # an empty installation target: nothing else is there
    install = subprocess.run([*pip, "install", "--no-deps", "--no-index", "-q", "--target",
                              str(site), wheel], capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr[-3000:]
    installed = {n for n in os.listdir(site) if not n.endswith(".dist-info") and n != "bin"}
    assert installed == {"hetjax"}, sorted(installed)
    for sub in ("layers", "parallel"):  # real folders with the files, not links
        path = site / "hetjax" / sub
        assert path.is_dir() and not path.is_symlink() and (path / "__init__.py").is_file()
