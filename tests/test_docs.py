"""Every fenced ```bash / ```python block of README.md and docs/**/*.md runs and succeeds.

The extraction, the marks (`<!-- doc-test: skip (why) -->`, `<!-- doc-test: slow -->`) and the
three substitution rules (a small step count, a fresh mirror of the repository root as the
working directory, this interpreter as `hetjax`/`python`) are scripts/tools/doc_blocks.py's; one test
per page, so pytest-xdist spreads them. Skipped blocks show in the summary with their reason
(`-rs`) and run with `python scripts/tools/doc_blocks.py --skipped`. A page's blocks run in order in one
directory (a block may use what an earlier one made): the default tier runs its blocks not
marked slow, the slow tier the whole page when it has slow blocks.
"""

import textwrap

import pytest



from scripts.tools import doc_blocks as db  # noqa: E402
BLOCKS = db.all_blocks()


PAGES: dict[str, list] = {}
for _b in BLOCKS:
    PAGES.setdefault(_b.path, []).append(_b)


def _page_params():
    for path, blocks in PAGES.items():
        runnable = [b for b in blocks if not b.skip]
        fast = [b for b in runnable if not b.slow]
        if fast:
            yield pytest.param(fast, id=path)
        if len(fast) < len(runnable):
            yield pytest.param(runnable, id=f"{path}[whole page]", marks=pytest.mark.slow)


def _explain(b, r) -> str:
    tail = (r.stdout[-3000:] + "\n--- stderr ---\n" + r.stderr[-4000:]).strip()
    return (f"the documented {b.lang} block at {b.name} failed (exit {r.returncode}); "
            f"run as:\n{textwrap.indent(db.substitute(b), '    ')}\n{tail}")


@pytest.mark.parametrize("blocks", list(_page_params()))
def test_documented_page_runs(blocks):
    failed = db.run_page(blocks, timeout=600)
    assert failed is None, _explain(*failed)


def test_docs_have_blocks_and_every_skip_says_why():
    assert len(BLOCKS) >= 10, [b.name for b in BLOCKS]
    assert all(b.skip and len(b.skip) > 8 for b in BLOCKS if b.skip is not None)
    print(f"\n{len(BLOCKS)} documented blocks: {sum(not b.skip for b in BLOCKS)} run here, "
          f"{sum(bool(b.skip) for b in BLOCKS)} marked skip:")
    for b in BLOCKS:
        if b.skip:
            print(f"  {b.name}: {b.skip}")


SYNTHETIC = """# A page

Text, then an output block that is never run:

```
$ hetjax train --config.train.stepz=1
```

<!-- doc-test: skip (why: needs root) -->
```bash
sudo hetjax testbed measure
```

<!-- doc-test: slow -->
```bash
hetjax train --config=configs/default.py   # the default job
hetjax plan --config.parallel.pp=0 --config.train.steps=500
```

```python
import hetjax
config = hetjax.load_config("configs/default.py", ["--config.train.steps=50"])
```
"""


def test_parse_reads_marks_and_ignores_other_fences():
    blocks = db.parse(SYNTHETIC, "page.md")
    assert [(b.line, b.lang, b.skip, b.slow) for b in blocks] == [
        (10, "bash", "why: needs root", False), (15, "bash", None, True),
        (20, "python", None, False)]


def test_substitution_rules_are_the_documented_ones():
    _, slow, py = db.parse(SYNTHETIC, "page.md")
    assert db.substitute(slow).splitlines() == [
        f"hetjax train --config=configs/default.py --config.train.steps={db.STEPS}"
        "   # the default job",
        f"hetjax plan --config.parallel.pp=0 --config.train.steps={db.STEPS}"]
    assert f'"--config.train.steps={db.STEPS}"' in db.substitute(py)
    chain = db.Block("x.md", 1, "bash", "pip install -e . && .venv/bin/hetjax launch \\\n"
                     "    --local 2 && echo done\n")
    assert db.substitute(chain) == (f"pip install -e . && .venv/bin/hetjax launch \\\n"
                                    f"    --local 2 --config.train.steps={db.STEPS} && echo done\n")


def test_a_renamed_flag_fails_the_doc_test(tmp_path):
    """The same documented command passes as written and fails once a flag is renamed."""
    good = "```bash\nhetjax plan --config.topology.preset=cpu_single --config.parallel.pp=1\n```\n"
    renamed = good.replace("parallel.pp=", "parallel.ppp=")
    (ok,), (bad,) = db.parse(good, "good.md"), db.parse(renamed, "renamed.md")
    assert db.run(ok).returncode == 0
    r = db.run(bad)
    assert r.returncode != 0
    assert "parallel.ppp" in r.stderr and "parallel.pp" in r.stderr.replace("ppp", "")


def test_a_failing_python_block_fails(tmp_path):
    (b,) = db.parse("```python\nimport hetjax\nhetjax.load_config(None, ['--config.x.y=1'])\n```\n")
    r = db.run(b)
    assert r.returncode != 0 and "config.x" in r.stderr
