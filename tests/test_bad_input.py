"""Bad input is one clear error before anything heavy: a config file, an override, a topology or
calibration file, a CLI flag, a tokenizer's training text -- each wrong in its own way, each one
line naming the field or file and the fix (docs/reliability.md).

`BAD_INPUTS` is the table docs/reliability.md shows: each case is a `hetjax` command line (with
`{tmp}` standing for a directory holding the files `_write_inputs` makes) and the exact error
it must print. `cd tests && python test_bad_input.py` prints the table as markdown.
"""

import json
import os
import sys

import pytest

from conftest import REPO, tiny_config


CONFIG_FILES = {
    "syntax.py": "def get_config(:\n",
    "dict.py": "def get_config():\n    return {'train': {'steps': 3}}\n",
    "partial.py": ("import ml_collections\n\ndef get_config():\n"
                   "    c = ml_collections.ConfigDict()\n"
                   "    c.train = ml_collections.ConfigDict()\n"
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
                  "topo_string_number.json": _topology(nic__bandwidth_gbps="ten"),
                  "topo_nan_latency.json": _topology(nic__latency_us=float("nan")),
                  "topo_fractional_nodes.json": _topology().replace('"nodes": 1', '"nodes": 2.5'),
                  "calibration_list.json": "[1, 2]\n"}


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
     "docs/topology.md shows the format"),
    ("topology file with a string where a number belongs",
     "topology --config.topology.file={tmp}/topo_string_number.json",
     "config.topology.file: '{tmp}/topo_string_number.json': clusters[0].nic.bandwidth_gbps: "
     "must be a number, got 'ten'\n  fix: write a number without quotes: the link's nominal "
     "rate per direction in Gbit/s, e.g. 25"),
    ("accelerator with peak_tflops 0",
     "plan --config.topology.file={tmp}/topo_zero_tflops.json",
     "config.topology.file: '{tmp}/topo_zero_tflops.json': clusters[0].accelerator.peak_tflops: "
     "must be > 0, got 0\n  fix: give the device's peak dense bf16 TFLOP/s, e.g. 312"),
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
    ("parallel.tp across nodes in hetjax plan",
     "plan --config.parallel.pp=2 --config.parallel.dp=1 --config.parallel.tp=4 "
     "--config.model.n_kv_heads=4",
     "the layout breaks hetjax's placement rules: TP group [0, 1, 2, 3] spans 2 nodes, so every "
     "layer's all-reduce crosses infiniband. Fix: choose tp <= devices per node and pp so each "
     "stage fits in a cluster, or set --config.parallel.allow_straddle=True to accept it."),
    ("--plot into a missing directory", "plan --plot {tmp}/no/plan.png",
     "--plot={tmp}/no/plan.png: directory {tmp}/no does not exist or is not writable; fix: "
     "create it, or give a path in an existing one"),
    ("--json into a missing directory", "plan --json={tmp}/no/plan.json",
     "--json={tmp}/no/plan.json: directory {tmp}/no does not exist or is not writable; fix: "
     "create it, or give a path in an existing one"),
    ("--json naming a directory", "plan --json={tmp}",
     "--json={tmp}: is a directory; fix: give a file name, e.g. --json={tmp}/out.json"),
    ("--plot with an unsupported extension (checked before planning)",
     "plan --plot={tmp}/plan.xyz",
     "--plot={tmp}/plan.xyz: cannot write a plot as .xyz; fix: end the name with one of .png, "
     ".pdf, .svg, .jpg, .jpeg"),
    ("tokenizer train --out naming a directory (checked before training)",
     "tokenizer train --vocab_size=300 --out={tmp}",
     "--out={tmp}: is a directory; fix: give a file name, e.g. --out={tmp}/tok.model"),
    ("an empty workdir", "train --config.workdir=",
     "config.workdir: is empty\n  fix: set --config.workdir to a directory, e.g. "
     "--config.workdir=runs/default"),
    ("a negative seed", "train --config.train.seed=-1",
     "config.train.seed: must be >= 0, got -1\n  fix: use 0, or any other non-negative integer "
     "(the parameters and the data order follow it)"),
    ("an infinite learning rate", "train --config.train.lr=inf",
     "config.train.lr: must be a finite number, got inf\n  fix: set it like its default, e.g. "
     "--config.train.lr=0.003"),
    ("a NaN DiLoCo outer learning rate", "train --config.diloco.outer_lr=nan",
     "config.diloco.outer_lr: must be a finite number, got nan\n  fix: set it like its "
     "default, e.g. --config.diloco.outer_lr=0.7"),
    ("a NaN latency in a topology file",
     "topology --config.topology.file={tmp}/topo_nan_latency.json",
     "config.topology.file: '{tmp}/topo_nan_latency.json': clusters[0].nic.latency_us: must "
     "be a finite number, got nan\n  fix: give one message's latency in µs, e.g. 5"),
    ("a fractional node count in a topology file",
     "topology --config.topology.file={tmp}/topo_fractional_nodes.json",
     "config.topology.file: '{tmp}/topo_fractional_nodes.json': clusters[0].nodes: must be a "
     "whole number, got 2.5\n  fix: give the number of nodes, e.g. 2"),
    ("a calibration file of valid JSON but the wrong shape",
     "plan --config.planner.calibration={tmp}/calibration_list.json",
     "planner.calibration: '{tmp}/calibration_list.json': not a hetjax calibration file "
     "(TypeError: the file holds a JSON list, not an object); write one with 'hetjax "
     "calibrate'"),
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


@pytest.mark.parametrize("error,line", [
    ((30, "Read-only file system", "/data/corpus/tokens.sp-1.ids.npy"),
     "/data/corpus/tokens.sp-1.ids.npy: Read-only file system; fix: choose a path you can "
     "write, or fix its permissions"),
    ((28, "No space left on device", "/runs/a/plan.json"),
     "/runs/a/plan.json: No space left on device; fix: free space on the disk holding "
     "/runs/a/plan.json (or choose a path on another disk)"),
], ids=["read-only", "full disk"])
def test_an_os_error_in_any_command_is_one_line(monkeypatch, capsys, error, line):
    """The CLI's error boundary: an OSError from any command (a read-only prepared corpus that
    needs a new token cache, a full disk) is one line naming the path and the fix."""
    from hetjax import cli

    def fails(argv):
        raise OSError(*error)

    monkeypatch.setitem(cli.COMMANDS, "topology", fails)
    assert cli.main(["hetjax", "topology"]) == 2
    assert capsys.readouterr().err == f"hetjax: error: {line}\n"


def test_cli_exit_codes_of_a_preemption_and_an_interrupt(monkeypatch, capsys):
    from hetjax import cli
    from hetjax.errors import Interrupted, Preempted

    for error, code in ((Preempted, 75), (Interrupted, 130)):
        monkeypatch.setitem(cli.COMMANDS, "train", lambda argv, e=error: (_ for _ in ()).throw(
            e("saved checkpoint 3")))
        assert cli.main(["hetjax", "train"]) == code
    assert capsys.readouterr().err == "hetjax: saved checkpoint 3\n" * 2


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


def test_a_calibration_from_other_hardware_is_said_once(capsys):
    from hetjax import config as hconfig
    from hetjax.planner.config_plan import options_from_config

    c = hconfig.base_config()
    c.planner.calibration = os.path.join(REPO, "docs/results/calibration_hetaccel_0808.json")
    c.topology.preset = "holmes_hybrid"
    topology = hconfig.build_topology(c)
    options_from_config(c, topology)
    options_from_config(c, topology)
    assert capsys.readouterr().err == (
        f"hetjax: warning: planner.calibration {c.planner.calibration!r}: it was measured on "
        "topology 'testbed_hetaccel' (cpu, cpu_half; links ethernet, infiniband, nvlink, roce),"
        " which has no a100 of this run's topology 'holmes_hybrid'; those are priced with "
        "nominal constants. fix: run 'hetjax calibrate' on this topology\n")


# --- SentencePiece training failures say what is wrong with the text ---------------------------
CJK = "".join(chr(0x4E00 + i) for i in range(400))


SENTENCEPIECE_FAILURES = [
    ("no text", [], 300,
     "SentencePiece training failed: the training documents hold no non-blank line; fix: train "
     "on text files with content"),
    ("only lines over 16,384 characters", ["x" * 20000], 300,
     "SentencePiece training failed: all 1 lines are longer than 16,384 characters, which "
     "SentencePiece skips; fix: break them into shorter lines"),
    ("a vocabulary larger than the text yields", ["hello world " * 50, "y" * 17000], 5000,
     "SentencePiece training failed: --vocab_size=5000 is more pieces than this text yields (at "
     "most 287); 1 of its 2 lines are longer than 16,384 characters, which SentencePiece skips "
     "(break them into shorter lines); fix: use --vocab_size=287 or less, or train on more "
     "text"),
    ("a vocabulary smaller than the text's characters", [CJK], 300,
     "SentencePiece training failed: --vocab_size=300 is smaller than the 660 distinct "
     "characters and special pieces of this text; fix: use --vocab_size=660 or more"),
]


@pytest.mark.parametrize("what,docs,vocab,error", SENTENCEPIECE_FAILURES,
                         ids=[c[0] for c in SENTENCEPIECE_FAILURES])
def test_sentencepiece_training_failures_are_accurate(tmp_path, what, docs, vocab, error):
    from hetjax.errors import HetjaxError
    from hetjax.tokenizer import train_sentencepiece

    with pytest.raises(HetjaxError) as e:
        train_sentencepiece(docs, vocab, str(tmp_path / "tok.model"))
    assert str(e.value) == error
    assert not os.path.exists(tmp_path / "tok.model")


def test_an_empty_tokenizer_model_file_is_named_as_empty(tmp_path):
    from hetjax.errors import HetjaxError
    from hetjax.tokenizer import load_tokenizer

    (tmp_path / "tok.model").write_bytes(b"")
    with pytest.raises(HetjaxError) as e:
        load_tokenizer(str(tmp_path / "tok.model"))
    assert str(e.value) == (f"the tokenizer model '{tmp_path}/tok.model' is an empty file; set "
                            "data.tokenizer to 'byte' or to a file written by 'hetjax tokenizer "
                            "train'")


def test_tilde_and_variables_in_path_fields_are_expanded_once(tmp_path, monkeypatch):
    from hetjax.config import validate

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("RUNS", "runs")
    c = tiny_config(workdir="~/$RUNS/a", **{"checkpoint.dir": "$HOME/ckpt"})
    validate(c)
    assert (c.workdir, c.checkpoint.dir) == (f"{tmp_path}/runs/a", f"{tmp_path}/ckpt")


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
