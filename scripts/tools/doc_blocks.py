"""The documented commands: every fenced ```bash / ```python block of README.md and docs/**/*.md,
extracted, made small by a few explicit rules, and run from (a mirror of) the repository root.

tests/test_docs.py runs every block that is not marked; this script lists the blocks and runs
the ones the suite leaves out (`--skipped`: they need root, a GPU or hours) or any one of them:

    python scripts/tools/doc_blocks.py --list
    python scripts/tools/doc_blocks.py --skipped          # run the marked blocks, as written
    python scripts/tools/doc_blocks.py README.md:75       # run one block (file:line of its fence)

A line right before a fence marks its block (several marks may stack):

    <!-- doc-test: skip (why: needs a GPU) -->   not run by the suite; run here with --skipped
    <!-- doc-test: slow -->                      run by the suite's slow tier only

The rules that make a block small (`substitute`; the only changes made to what is written):

1. `--config.train.steps=N` becomes `--config.train.steps=STEPS` when N is larger, in any block;
2. a `hetjax train` or `hetjax launch` command that sets no step count gets
   `--config.train.steps=STEPS` appended (before a trailing `# comment`);
3. every page's blocks run in order in one fresh temporary directory that mirrors the
   repository root (a link to each top-level entry but `runs/`; `docs/` is copied, so a
   command that redraws a figure there writes the copy), so a block can use what an earlier
   block of its page made (`runs/...`, `plan.json`), and nothing lands in the checkout;
   `hetjax` and `python` on its PATH are this interpreter's.

`--skipped` runs blocks as written (no rule 1 or 2) in the checkout itself, as a user would.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 3
FENCE = re.compile(r"^```(bash|python)\s*$")
SKIP = re.compile(r"^<!--\s*doc-test:\s*skip\s*\((.+)\)\s*-->\s*$")
SLOW = re.compile(r"^<!--\s*doc-test:\s*slow\s*-->\s*$")
STEPS_FLAG = re.compile(r"--config\.train\.steps=(\d+)")
# `hetjax train ...` / `hetjax launch ...` at the start of a shell command (after `&&`, `;`, a
# path such as .venv/bin/, or `sudo`).
TRAIN_CMD = re.compile(r"(^|&&|;|\|\|)\s*(sudo\s+)?(\S*/)?hetjax\s+(train|launch)\b")


@dataclasses.dataclass(frozen=True)
class Block:
    path: str  # relative to the repository root
    line: int  # 1-based line of the opening fence
    lang: str  # "bash" | "python"
    code: str
    skip: str | None = None  # the reason given in the skip mark
    slow: bool = False

    @property
    def name(self) -> str:
        return f"{self.path}:{self.line}"


def doc_files(root: str = REPO) -> list[str]:
    """README.md and every markdown file under docs/, relative to root, in a stable order."""
    files = ["README.md"] if os.path.isfile(os.path.join(root, "README.md")) else []
    files += sorted(os.path.relpath(p, root) for p in
                    glob.glob(os.path.join(root, "docs", "**", "*.md"), recursive=True))
    return files


def parse(text: str, path: str = "<text>") -> list[Block]:
    """The fenced bash/python blocks of one markdown text, with their marks."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            if lines[i].startswith("```"):  # another fence (output, text): skip to its end
                i += 1
                while i < len(lines) and not lines[i].startswith("```"):
                    i += 1
            i += 1
            continue
        start, body = i, []
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        if i == len(lines):
            raise ValueError(f"{path}:{start + 1}: a ```{m.group(1)} block is never closed")
        skip, slow, j = None, False, start - 1
        while j >= 0 and (SKIP.match(lines[j]) or SLOW.match(lines[j])):
            s = SKIP.match(lines[j])
            if s:
                skip = s.group(1).strip()
            else:
                slow = True
            j -= 1
        blocks.append(Block(path, start + 1, m.group(1), "\n".join(body) + "\n", skip, slow))
        i += 1
    return blocks


def all_blocks(root: str = REPO) -> list[Block]:
    out = []
    for rel in doc_files(root):
        with open(os.path.join(root, rel), encoding="utf-8") as f:
            out += parse(f.read(), rel)
    return out


def _shell_lines(code: str) -> list[str]:
    """Logical shell lines: backslash continuations joined (with the newline kept)."""
    out, cur = [], ""
    for line in code.splitlines():
        if line.rstrip().endswith("\\"):
            cur += line + "\n"
            continue
        out.append(cur + line)
        cur = ""
    if cur:
        out.append(cur)
    return out


def _append_steps(line: str) -> str:
    """Rule 2 on one logical shell line: each `hetjax train|launch` command in it without a step
    count gets one (before a trailing comment; each command of an `&&` chain on its own)."""
    if not TRAIN_CMD.search(line) or STEPS_FLAG.search(line):
        return line
    comment = ""
    m = re.search(r"\s+#\s.*$", line)
    if m:
        line, comment = line[:m.start()], line[m.start():]
    parts = re.split(r"(&&|;|\|\|)", line)
    for k in range(0, len(parts), 2):
        if TRAIN_CMD.search(parts[k]):
            stripped = parts[k].rstrip()
            parts[k] = f"{stripped} --config.train.steps={STEPS}" + parts[k][len(stripped):]
    return "".join(parts) + comment


def substitute(block: Block, steps: int = STEPS) -> str:
    """The block's code after rules 1 and 2 (module docstring)."""
    code = STEPS_FLAG.sub(lambda m: f"--config.train.steps={min(int(m.group(1)), steps)}",
                          block.code)
    if block.lang == "bash":
        code = "\n".join(_append_steps(line) for line in _shell_lines(code)) + "\n"
    return code


def mirror(root: str, into: str) -> None:
    """Rule 3: a directory that looks like the repository root (links to its top-level entries,
    without runs/ and virtual environments), and a bin/ with this interpreter as hetjax/python."""
    for entry in os.listdir(root):
        if entry in ("runs", ".venv", ".git", "__pycache__", ".pytest_cache"):
            continue
        if entry == "docs":
            shutil.copytree(os.path.join(root, entry), os.path.join(into, entry))
        else:
            os.symlink(os.path.join(root, entry), os.path.join(into, entry))
    shims(into)


def shims(into: str) -> str:
    """<into>/.doc-test-bin holding `hetjax`, `python` and `python3` that run this interpreter
    (what `pip install -e .` puts on a user's PATH); returns the directory."""
    bindir = os.path.join(into, ".doc-test-bin")
    os.makedirs(bindir)
    exe = shlex.quote(sys.executable)
    for name, body in (("hetjax", f"{exe} -m hetjax"), ("python", exe), ("python3", exe)):
        p = os.path.join(bindir, name)
        with open(p, "w") as f:
            f.write(f'#!/bin/sh\nexec {body} "$@"\n')
        os.chmod(p, 0o755)
    return bindir


def run(block: Block, *, root: str = REPO, as_written: bool = False, timeout: float = 600,
        capture: bool = True, into: str | None = None) -> subprocess.CompletedProcess:
    """Run one block: in a mirror of root with rules 1-3 (`into`: a mirror made by an earlier
    block of the same page, kept), or (as_written) in root itself."""
    code = block.code if as_written else substitute(block)
    tmp = into or tempfile.mkdtemp(prefix="hetjax-doc-")
    try:
        cwd = root if as_written else tmp
        if as_written:
            bindir = shims(tmp)
        else:
            if into is None:
                mirror(root, tmp)
            bindir = os.path.join(tmp, ".doc-test-bin")
        env = dict(os.environ)
        env.pop("XLA_FLAGS", None)  # a user's shell: hetjax gives itself its simulated devices
        env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
        if block.lang == "bash":
            argv = ["bash", "-e", "-o", "pipefail", "-c", code]
        else:
            script = os.path.join(tmp, "doc_block.py")
            with open(script, "w") as f:
                f.write(code)
            argv = [sys.executable, script]
        return subprocess.run(argv, cwd=cwd, env=env, timeout=timeout, text=True,
                              capture_output=capture)
    finally:
        if into is None:
            shutil.rmtree(tmp, ignore_errors=True)


def run_page(blocks: list[Block], *, root: str = REPO, timeout: float = 600
             ) -> tuple[Block, subprocess.CompletedProcess] | None:
    """Run a page's blocks in order in one mirror (rule 3); the first that fails, with its
    result, or None when all pass."""
    tmp = tempfile.mkdtemp(prefix="hetjax-doc-")
    try:
        mirror(root, tmp)
        for b in blocks:
            r = run(b, root=root, timeout=timeout, into=tmp)
            if r.returncode:
                return b, r
        return None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "),
                                 epilog="Marks and rules: see this file's docstring.")
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--list", action="store_true", help="list every block and its mark")
    what.add_argument("--skipped", action="store_true",
                      help="run the blocks marked skip, as written, in the checkout")
    what.add_argument("blocks", nargs="*", default=[], metavar="FILE:LINE",
                      help="run these blocks (file:line of the fence, as --list names them)")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    blocks = all_blocks()
    if args.list:
        for b in blocks:
            mark = f"skip ({b.skip})" if b.skip else ("slow" if b.slow else "suite")
            first = b.code.splitlines()[0] if b.code.strip() else ""
            print(f"{b.name:28s} {b.lang:6s} {mark}: {first}")
        print(f"{len(blocks)} blocks: {sum(not b.skip for b in blocks)} run by the suite "
              f"({sum(b.slow and not b.skip for b in blocks)} slow), "
              f"{sum(bool(b.skip) for b in blocks)} marked skip")
        return 0
    if args.skipped:
        chosen, as_written = [b for b in blocks if b.skip], True
    else:
        by_name = {b.name: b for b in blocks}
        unknown = [a for a in args.blocks if a not in by_name]
        if unknown:
            print(f"doc_blocks: no block at {', '.join(unknown)}; see --list", file=sys.stderr)
            return 2
        chosen, as_written = [by_name[a] for a in args.blocks], False
    failed = []
    for b in chosen:
        print(f"== {b.name} ({b.lang}{', ' + b.skip if b.skip else ''})", flush=True)
        r = run(b, as_written=as_written, capture=False)
        if r.returncode:
            failed.append(b.name)
    print(f"{len(chosen) - len(failed)} of {len(chosen)} blocks passed"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
