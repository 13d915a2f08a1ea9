"""Reliability (issue 16): every bad input is one clear error before anything heavy, a
non-finite step is skipped and never saved, a corrupt checkpoint is set aside, SIGTERM saves
and exits with its own code.

`BAD_INPUTS` is the table docs/reliability.md shows: each case is a `hetjax` command line (with
`{tmp}` standing for a directory holding the files `_write_inputs` makes) and the exact error
it must print. `python tests/test_reliability.py` prints the table as markdown.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, tiny_config

CONFIG_FILES = {
    "syntax.py": "def get_config(:\n",
    "dict.py": "def get_config():\n    return {'train': {'steps': 3}}\n",
    "partial.py": ("import ml_collections\n\ndef get_config():\n"
                   "    c = ml_collections.ConfigDict()\n    c.train = ml_collections.ConfigDict()\n"
                   "    c.train.steps = 3\n    return c\n"),
    "badtype.py": ("from hetjax.config import base_config\n\ndef get_config():\n"
                   "    c = base_config()\n    c.train.steps = 'ten'\n    return c\n"),
    "unknown.py": ("from hetjax.config import base_config\n\ndef get_config():\n"
                   "    c = base_config()\n    c.train.stepz = 10\n    return c\n"),
    "config.json": '{"train": {"steps": 3}}\n',
    "topo_bad.json": "{bad\n",
    "afile": "",
}
_CLUSTER = {"name": "a", "nodes": 1, "devices_per_node": 2,
            "accelerator": {"name": "cpu", "peak_tflops": 1.0, "memory_gib": 2.0},
            "nic": {"kind": "ethernet", "bandwidth_gbps": 10, "latency_us": 5},
            "intra_node": {"kind": "loopback", "bandwidth_gbps": 100, "latency_us": 1}}


def _topology(**accelerator_or_nic) -> str:
    c = json.loads(json.dumps(_CLUSTER))
    for k, v in accelerator_or_nic.items():
        part, field = k.split("__")
        c[part][field] = v
    return json.dumps({"name": "x", "clusters": [c], "inter_cluster": None})


TOPOLOGY_FILES = {"topo_zero_tflops.json": _topology(accelerator__peak_tflops=0),
                  "topo_string_number.json": _topology(nic__bandwidth_gbps="ten")}

# (what a user tried, hetjax command line, the exact error it prints)
BAD_INPUTS = [
    ("config file missing", "topology --config={tmp}/missing.py",
     "--config={tmp}/missing.py: no such file; fix: give a Python file with get_config() "
     "returning a ConfigDict, e.g. --config=configs/default.py"),
    ("config file with a syntax error", "topology --config={tmp}/syntax.py",
     "--config={tmp}/syntax.py: syntax error at line 1: invalid syntax; fix: correct line 1"),
    ("get_config() returns a dict", "topology --config={tmp}/dict.py",
     "--config={tmp}/dict.py: get_config() returned a dict, not a ConfigDict; fix: start from "
     "hetjax.config.base_config() and return it with your changes"),
    ("get_config() returns a partial ConfigDict", "topology --config={tmp}/partial.py",
     "config.checkpoint: is missing\n  fix: start the config from hetjax.config.base_config() "
     "(it has every field) and change what you need"),
    ("a field of the wrong type set in a config file", "topology --config={tmp}/badtype.py",
     "--config={tmp}/badtype.py: line 5 (c.train.steps = 'ten'): TypeError: Could not override "
     "field 'steps' (reference). ten is of original type 'str' and cannot be casted to type "
     "'int'; fix: correct that line (field types are those of base_config())"),
    ("an unknown field set in a config file", "topology --config={tmp}/unknown.py",
     "config.train.stepz: is not a hetjax config field\n  fix: did you mean train.steps?"),
    ("a JSON file passed as --config", "topology --config={tmp}/config.json",
     "--config={tmp}/config.json: a config is a Python file, not .json; fix: give a Python file "
     "with get_config() returning a ConfigDict, e.g. --config=configs/default.py"),
    ("misspelled override", "topology --config.train.stepz=3",
     "config.train.stepz: is not a hetjax config field\n  fix: did you mean train.steps?"),
    ("misspelled section", "topology --config.trian.steps=3",
     "config.trian: is not a hetjax config field\n  fix: did you mean train?"),
    ("override of the wrong type", "topology --config.train.steps=ten",
     "config.train.steps: cannot take the value 'ten' (invalid literal for int() with base 10: "
     "ten)\n  fix: give it a value like its default, e.g. --config.train.steps=300"),
    ("topology file with invalid JSON", "topology --config.topology.file={tmp}/topo_bad.json",
     "config.topology.file: '{tmp}/topo_bad.json' is not valid JSON (line 1, column 2: "
     "Expecting property name enclosed in double quotes)\n  fix: fix the JSON; "
     "Topology.to_json() shows the format"),
    ("topology file with a string where a number belongs",
     "topology --config.topology.file={tmp}/topo_string_number.json",
     "config.topology.file: '{tmp}/topo_string_number.json': ethernet link bandwidth_gbps must "
     "be a number, got 'ten'; write it without quotes\n  fix: correct that entry of the file"),
    ("accelerator with peak_tflops 0",
     "plan --config.topology.file={tmp}/topo_zero_tflops.json",
     "config.topology.file: '{tmp}/topo_zero_tflops.json': accelerator 'cpu' peak_tflops must "
     "be > 0, got 0; give the device's peak dense bf16 TFLOP/s and memory in GiB\n  fix: "
     "correct that entry of the file"),
    ("topology.file and topology.preset both set",
     "topology --config.topology.file={tmp}/topo_bad.json "
     "--config.topology.preset=holmes_hybrid",
     "config.topology.preset: is 'holmes_hybrid' but topology.file = '{tmp}/topo_bad.json' is "
     "set too; the file would silently win\n  fix: set only one of topology.file and "
     "topology.preset"),
    ("model vocabulary smaller than the tokenizer's", "train --config.model.vocab_size=100",
     "config.model.vocab_size: 100 is smaller than the tokenizer's 257 tokens (data.tokenizer = "
     "'byte')\n  fix: set --config.model.vocab_size=0 (sized from the tokenizer) or >= 257"),
    ("missing data.path", "train --config.data.source=files --config.data.path={tmp}/texts",
     "config.data.path: '{tmp}/texts' matches no file or directory\n  fix: give an existing "
     "directory of text files or a glob like '/data/*.txt'"),
    ("workdir is a file", "train --config.workdir={tmp}/afile",
     "config.workdir: {tmp}/afile exists and is not a directory\n  fix: choose another "
     "--config.workdir"),
    ("workdir cannot be created", "train --config.workdir={tmp}/afile/run",
     "config.workdir: {tmp}/afile/run cannot be written ({tmp}/afile is a file)\n  fix: choose "
     "a --config.workdir under a directory you can write"),
    ("custom ZeRO point with s_p > s_os",
     "plan --config.zero.preset=custom --config.zero.s_p=3",
     "config.zero.s_p: s_p = 3 is larger than s_os = 1; each optimizer-state shard must lie "
     "inside its device's parameter shard, so s_p must divide s_os\n  fix: choose zero.s_p "
     "from the divisors of s_os = 1: [1]"),
    ("--plot into a missing directory", "plan --plot {tmp}/no/plan.png",
     "--plot={tmp}/no/plan.png: directory {tmp}/no does not exist or is not writable; fix: "
     "create it, or give a path in an existing one"),
    ("--json into a missing directory", "plan --json={tmp}/no/plan.json",
     "--json={tmp}/no/plan.json: directory {tmp}/no does not exist or is not writable; fix: "
     "create it, or give a path in an existing one"),
]


def _write_inputs(tmp: str) -> None:
    for name, text in {**CONFIG_FILES, **TOPOLOGY_FILES}.items():
        with open(os.path.join(tmp, name), "w") as f:
            f.write(text)


def run_cli(command_line: str, tmp: str) -> tuple[int, str]:
    """Run `hetjax <command_line>` in this process; its exit code and what it printed to
    stderr. None of BAD_INPUTS gets as far as importing JAX's devices."""
    import contextlib
    import io

    from hetjax import cli

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = cli.main(["hetjax", *command_line.format(tmp=tmp).split()])
    return rc, err.getvalue()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("inputs"))
    _write_inputs(tmp)
    return tmp


@pytest.mark.parametrize("what,command_line,error", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_one_clear_error(inputs, what, command_line, error):
    rc, err = run_cli(command_line, inputs)
    assert rc == 2
    assert err == f"hetjax: error: {error.format(tmp=inputs)}\n"


def test_unknown_field_set_from_python_is_refused():
    from hetjax.config import validate
    from hetjax.errors import ConfigError

    c = tiny_config()
    c.train.stepz = 10
    with pytest.raises(ConfigError) as e:
        validate(c)
    assert str(e.value) == "config.train.stepz: is not a hetjax config field\n" \
                           "  fix: did you mean train.steps?"


def test_a_field_of_the_wrong_type_set_from_python_is_refused():
    from hetjax.config import validate
    from hetjax.errors import ConfigError

    c = tiny_config()
    c.data.unlock()
    del c.data["path"]
    c.data.path = 3  # a new field of another type: ConfigDict's own type check cannot see it
    with pytest.raises(ConfigError) as e:
        validate(c)
    assert str(e.value) == "config.data.path: must be a str, got 3 (int)\n" \
                           "  fix: set it like its default, e.g. --config.data.path=''"


def markdown_table(tmp: str) -> str:
    rows = ["| bad input | command | outcome |", "|---|---|---|"]
    for what, command_line, _ in BAD_INPUTS:
        rc, err = run_cli(command_line, tmp)
        shown = err.strip().replace(tmp, "$TMP").replace("\n", "<br>").replace("|", "\\|")
        rows.append(f"| {what} | `hetjax {command_line.format(tmp='$TMP')}` | exit {rc}: "
                    f"`{shown}` |")
    return "\n".join(rows)


if __name__ == "__main__":
    import tempfile

    sys.path.insert(0, REPO)
    with tempfile.TemporaryDirectory() as d:
        _write_inputs(d)
        print(markdown_table(d))
