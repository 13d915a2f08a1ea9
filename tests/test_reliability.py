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


# --- a run never goes on with, or saves, non-finite values -----------------------------------
@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    """One compiled tiny trainer (untied embeddings, so one poisoned embedding row makes only
    the batches holding that token non-finite), reset between tests by `fresh`."""
    from hetjax.train import Trainer

    c = tiny_config(**{"model.tie_embeddings": False, "checkpoint.every": 2,
                       "checkpoint.async_save": False, "train.steps": 4, "train.log_every": 1,
                       "train.warmup_steps": 0})
    return Trainer(c, workdir=str(tmp_path_factory.mktemp("run")), quiet=True)


def fresh(trainer, workdir, **config):
    """The trainer as if new in `workdir` (same compiled executor): initial state, data from
    the start, no checkpointer yet."""
    for key, value in config.items():
        *section, field = key.split(".")
        (trainer.config[section[0]] if section else trainer.config)[field] = value
    trainer.workdir = str(workdir)
    trainer.state = trainer.init_state()
    if trainer._checkpointer is not None:
        trainer._checkpointer.close()
    trainer._data = trainer._checkpointer = None
    return trainer


def poison(trainer, rows):
    """NaN in the embedding rows `rows` of the trainer's state."""
    import jax
    import jax.numpy as jnp

    p = trainer.state.params
    emb = p["embedder"]["embedding"]
    emb = jax.device_put(emb.at[rows].set(jnp.nan), emb.sharding)
    trainer.state = trainer.state.replace(params={**p, "embedder": {"embedding": emb}})


def test_a_non_finite_step_is_skipped_and_training_goes_on(trainer, tmp_path):
    import jax
    import numpy as np

    fresh(trainer, tmp_path)
    token = 7
    poison(trainer, token)
    batch = next(trainer.data)
    good = {k: np.where(v == token, token + 1, v) for k, v in batch.items()}
    bad = {k: v.copy() for k, v in good.items()}
    bad["inputs"][0, 0] = token
    before = jax.device_get(trainer.state.params)
    m = jax.device_get(trainer.step(bad))
    assert np.isnan(m["loss"]) and np.isnan(m["grad_norm"])
    after = jax.device_get(trainer.state)
    assert int(after.step) == 1  # the batch is consumed, the update is not applied
    jax.tree.map(np.testing.assert_array_equal, after.params, before)
    m = jax.device_get(trainer.step(good))
    assert np.isfinite(m["loss"]) and np.isfinite(m["grad_norm"])
    assert not np.array_equal(jax.device_get(trainer.state.params["lm_head"]["kernel"]),
                              before["lm_head"]["kernel"])


@pytest.mark.slow  # the rule itself is checked in the default tier by test_a_non_finite_step_is_skipped_and_training_goes_on
def test_the_mpmd_executor_skips_a_non_finite_step_on_every_stage():
    import jax
    import numpy as np

    from hetjax.train import Trainer

    c = tiny_config(**{"model.d_model": 32, "model.d_ff": 64, "model.tie_embeddings": False,
                       "parallel.pp": 2, "parallel.dp": 4, "parallel.tp": 1,
                       "pipeline.stage_layers": (1, 1), "pipeline.executor": "mpmd",
                       "pipeline.microbatches": 1, "train.batch_size": 4,
                       "train.warmup_steps": 0})
    trainer = Trainer(c, quiet=True)
    token = 5
    natural = trainer.params
    emb = natural["embedder"]["embedding"]
    trainer.state = trainer.executor.from_natural_params(
        {**natural, "embedder": {"embedding": emb.at[token].set(np.nan)}})
    batch = next(trainer.data)
    good = {k: np.where(v == token, token + 1, v) for k, v in batch.items()}
    bad = {k: v.copy() for k, v in good.items()}
    bad["inputs"][0, 0] = token
    before = jax.device_get(trainer.params)
    m = jax.device_get(trainer.step(bad))
    assert np.isnan(m["loss"]) and np.isnan(m["grad_norm"])
    assert int(trainer.state.step) == 1
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(trainer.params), before)
    m = jax.device_get(trainer.step(good))
    assert np.isfinite(m["loss"]) and np.isfinite(m["grad_norm"])
    after = jax.device_get(trainer.params)
    up = [x["layers"]["block"]["mlp"]["up"]["kernel"] for x in (before, after)]
    for layer in (0, 1):  # the layer of each stage trained again
        assert not np.array_equal(up[0][layer], up[1][layer])


def test_max_bad_steps_in_a_row_stop_the_run(trainer, tmp_path, capsys):
    from hetjax.errors import HetjaxError

    fresh(trainer, tmp_path, **{"train.max_bad_steps": 2, "checkpoint.every": 0})
    poison(trainer, slice(None))  # every batch is non-finite
    try:
        with pytest.raises(HetjaxError) as e:
            trainer.train()
    finally:
        fresh(trainer, tmp_path, **{"train.max_bad_steps": 3, "checkpoint.every": 2})
    assert str(e.value) == (
        "train.max_bad_steps: 2 steps in a row (1-2) had a non-finite loss or gradient norm; "
        f"training stopped, nothing of them was saved (checkpoints in {tmp_path}/checkpoints); "
        "fix: lower train.lr (= 0.003) or train.grad_clip (= 1), check model.vocab_size and the "
        "data, then rerun to resume from the latest checkpoint")
    assert capsys.readouterr().err.splitlines() == [
        "hetjax: step 1: loss nan, grad_norm nan: update skipped (1 in a row, "
        "train.max_bad_steps = 2)",
        "hetjax: step 2: loss nan, grad_norm nan: update skipped (2 in a row, "
        "train.max_bad_steps = 2)"]


def test_a_checkpoint_never_holds_a_non_finite_value(trainer, tmp_path):
    from hetjax.errors import HetjaxError

    fresh(trainer, tmp_path)
    trainer.save(wait=True)  # a good one first
    poison(trainer, 3)
    with pytest.raises(HetjaxError) as e:
        trainer.save(wait=True)
    assert str(e.value) == (
        "checkpoint 0: refusing to save a state with NaN/Inf values in params/embedder/embedding;"
        f" the latest good checkpoint in {tmp_path}/checkpoints is kept; fix: rerun to resume "
        "from it, with a lower train.lr")
    assert trainer.checkpointer.steps() == [0]


# --- corrupt checkpoints are set aside, the run resumes from the newest good one ---------------
@pytest.fixture(scope="module")
def saved_run(trainer, tmp_path_factory):
    """A 4-step run with checkpoints at steps 2 and 4, and its losses."""
    from hetjax.metrics import read_metrics

    workdir = tmp_path_factory.mktemp("saved")
    fresh(trainer, workdir).train()
    losses = [r["loss"] for r in read_metrics(os.path.join(workdir, "metrics.jsonl"))]
    return str(workdir), losses


def _largest_array_file(step_dir):
    files = [os.path.join(r, f) for r, _, fs in os.walk(os.path.join(step_dir, "state"))
             for f in fs if os.sep + "d" + os.sep in os.path.join(r, f)]
    return max(files, key=os.path.getsize)


def _truncate(path, size=None):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2 if size is None else size)


# (what is broken, how, the step set aside, the part of the report in parentheses)
CORRUPTIONS = [
    ("a truncated array file", lambda d: _truncate(_largest_array_file(d + "/4")), 4,
     "Exception: Encountered error while reading array index: "),
    ("a truncated metadata file", lambda d: _truncate(d + "/4/state/_METADATA", 100), 4,
     "JSONDecodeError: "),
    ("a garbled meta item", lambda d: open(d + "/4/meta/metadata", "w").write("{bad"), 4,
     "JSONDecodeError: Expecting property name enclosed in double quotes: line 1 column 2 "
     "(char 1)"),
    ("a junk step directory", lambda d: (os.makedirs(d + "/6"), open(d + "/6/x", "w").write(
        "junk")), 6, "KeyError: 'Item \"data\" was not found in the checkpoint. Available "
     "items: []'"),
]


@pytest.mark.parametrize("what,corrupt,step,detail", CORRUPTIONS,
                         ids=[c[0] for c in CORRUPTIONS])
def test_a_corrupt_checkpoint_is_set_aside_and_the_newest_good_one_restored(
        trainer, saved_run, tmp_path, capsys, what, corrupt, step, detail):
    import jax
    import numpy as np

    src, _ = saved_run
    shutil.copytree(os.path.join(src, "checkpoints"), tmp_path / "checkpoints")
    ckpt = str(tmp_path / "checkpoints")
    corrupt(ckpt)
    fresh(trainer, tmp_path)
    newest_good = 4 if step == 6 else 2
    assert trainer.restore() == newest_good
    err = capsys.readouterr().err.strip()
    prefix = f"hetjax: checkpoint {step} in {ckpt} cannot be read ({detail}"
    suffix = f"); moved aside to {step}.corrupt, trying the previous one"
    assert err.startswith(prefix) and err.endswith(suffix) and "\n" not in err, err
    assert os.path.isdir(os.path.join(ckpt, f"{step}.corrupt"))
    assert trainer.checkpointer.steps() == ([2, 4] if step == 6 else [2])
    assert int(trainer.state.step) == newest_good
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(jax.device_get(trainer.params)))


def test_a_checkpoint_of_another_model_is_an_error_and_stays_in_place(trainer, saved_run,
                                                                       tmp_path):
    import jax
    import jax.numpy as jnp

    from hetjax.errors import HetjaxError

    src, _ = saved_run
    ckpt = str(tmp_path / "checkpoints")
    shutil.copytree(os.path.join(src, "checkpoints"), ckpt)
    fresh(trainer, tmp_path)
    layout = trainer.layout()
    target = layout.natural_target()
    other = jax.ShapeDtypeStruct((7,), jnp.float32, sharding=target.step.sharding)
    layout.natural_target = lambda: target.replace(step=other)
    with pytest.raises(HetjaxError) as e:
        trainer.checkpointer.restore(layout)
    # found in the checkpoint's metadata, before orbax starts reading arrays (whose reads in
    # flight printed a traceback each after the error)
    assert str(e.value) == (
        f"checkpoint 4 in {ckpt} does not fit this model and optimizer (step: stored (), this "
        "model (7,)); resume with the model config it was written with (see its meta/ item) or "
        "use another workdir")
    assert trainer.checkpointer.steps() == [2, 4]


# --- preemption: SIGTERM saves the current step and exits with its own code -------------------
def test_sigterm_saves_the_current_step_and_the_rerun_continues_identically(trainer, saved_run,
                                                                           tmp_path):
    from hetjax.errors import Preempted
    from hetjax.metrics import read_metrics

    _, reference = saved_run
    fresh(trainer, tmp_path)
    # The signal arrives during step 3 as from a scheduler; checkpoints are every 2 steps.
    hook = trainer.add_hook(lambda info: os.kill(os.getpid(), signal.SIGTERM)
                            if info.step == 3 else None)
    try:
        with pytest.raises(Preempted) as e:
            trainer.train()
    finally:
        trainer.hooks.remove(hook)
    assert str(e.value) == (
        f"preempted (SIGTERM) after step 3: saved checkpoint 3 in {tmp_path}/checkpoints; "
        "rerun the same command to resume (exit code 75)")
    assert trainer.checkpointer.steps() == [2, 3]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is put back
    summary = fresh(trainer, tmp_path, tensorboard=True).train()
    trainer.config.tensorboard = False
    assert summary["resumed_from"] == 3
    rows = read_metrics(os.path.join(tmp_path, "metrics.jsonl"))
    assert [r["loss"] for r in rows] == reference
    # TensorBoard holds each step once, with the metrics file's values.
    assert tensorboard_scalars(tmp_path / "tensorboard", "train/loss") == \
        [(r["step"], pytest.approx(r["loss"])) for r in rows]


def tensorboard_scalars(tb_dir, tag):
    """(step, value) of `tag` in every event file under `tb_dir` (TFRecord framing)."""
    import struct

    from tensorboardX.proto import event_pb2

    out = []
    for name in sorted(os.listdir(tb_dir)):
        data = open(os.path.join(tb_dir, name), "rb").read()
        pos = 0
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + n])
            pos += 16 + n
            out += [(event.step, v.simple_value) for v in event.summary.value if v.tag == tag]
    return sorted(out)


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


# --- never lose a run: every way a run stops resumes to the losses of an uninterrupted run ----
def _losses(workdir):
    from hetjax.metrics import read_metrics

    rows = read_metrics(os.path.join(workdir, "metrics.jsonl"))
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))  # each step once
    return [r["loss"] for r in rows]


def _stop_at(trainer, step, *signals):
    """A hook that sends `signals` to this process after `step`, as a scheduler or a user."""
    return trainer.add_hook(lambda info: [os.kill(os.getpid(), s) for s in signals]
                            if info.step == step else None)


def _train_expecting(trainer, error, hook=None):
    try:
        with pytest.raises(error) as e:
            trainer.train()
    finally:
        if hook is not None:
            trainer.hooks.remove(hook)
    return str(e.value)


def test_sigterm_without_periodic_checkpoints_resumes_from_its_save(trainer, saved_run, tmp_path):
    from hetjax.errors import Preempted

    _, reference = saved_run
    fresh(trainer, tmp_path, **{"checkpoint.every": 0})
    try:
        message = _train_expecting(trainer, Preempted, _stop_at(trainer, 2, signal.SIGTERM))
        assert message.startswith("preempted (SIGTERM) after step 2: saved checkpoint 2 in ")
        summary = fresh(trainer, tmp_path, **{"checkpoint.every": 0}).train()
    finally:
        fresh(trainer, tmp_path, **{"checkpoint.every": 2})
    assert summary["resumed_from"] == 2
    assert _losses(tmp_path) == reference


def test_sigint_saves_the_current_step_and_exits_130(trainer, saved_run, tmp_path):
    from hetjax.errors import Interrupted

    _, reference = saved_run
    fresh(trainer, tmp_path)
    message = _train_expecting(trainer, Interrupted, _stop_at(trainer, 3, signal.SIGINT))
    assert message == (f"interrupted (SIGINT) after step 3: saved checkpoint 3 in "
                       f"{tmp_path}/checkpoints; rerun the same command to resume (exit code 130)")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back
    assert fresh(trainer, tmp_path).train()["resumed_from"] == 3
    assert _losses(tmp_path) == reference


def test_a_second_sigint_stops_at_once_and_names_the_lost_steps(trainer, saved_run, tmp_path):
    from hetjax.errors import Interrupted

    _, reference = saved_run
    fresh(trainer, tmp_path)
    hook = _stop_at(trainer, 3, signal.SIGINT, signal.SIGINT)
    message = _train_expecting(trainer, Interrupted, hook)
    assert message == ("interrupted (second SIGINT) after step 3, without saving: steps 3-3 are "
                       "lost; rerun the same command to resume from checkpoint 2 (exit code 130)")
    assert trainer.checkpointer.steps() == [2]
    assert not os.path.exists(tmp_path / "hetjax.lock")  # released however the run ends
    assert fresh(trainer, tmp_path).train()["resumed_from"] == 2
    assert _losses(tmp_path) == reference


@pytest.mark.parametrize("where", ["metrics", "checkpoint"])
def test_a_full_disk_is_one_error_and_the_rerun_loses_nothing(trainer, saved_run, tmp_path,
                                                              monkeypatch, where):
    """ENOSPC while writing a metrics row or a checkpoint (the writer patched to fail as on a
    full disk): one error naming the path and the kept checkpoint; the rerun resumes."""
    import errno

    from hetjax import checkpoint as hckpt
    from hetjax import metrics as hmetrics
    from hetjax.errors import HetjaxError

    _, reference = saved_run
    fresh(trainer, tmp_path)
    cls, name = ((hmetrics.MetricsWriter, "write") if where == "metrics"
                 else (hckpt.Checkpointer, "save"))
    real = getattr(cls, name)
    path = str(tmp_path / ("metrics.jsonl" if where == "metrics" else "checkpoints/4"))

    def full(self, step, *args, **kw):
        if step == (3 if where == "metrics" else 4):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return real(self, step, *args, **kw)

    monkeypatch.setattr(cls, name, full)
    message = _train_expecting(trainer, HetjaxError)
    assert message == (
        f"training stopped: {path}: No space left on device; fix: free space on the disk "
        f"holding {path} (or choose a path on another disk); then rerun the same command to "
        f"resume (checkpoint 2 in {tmp_path}/checkpoints is kept)")
    monkeypatch.setattr(cls, name, real)
    assert fresh(trainer, tmp_path).train()["resumed_from"] == 2
    assert _losses(tmp_path) == reference


@pytest.mark.root
@pytest.mark.slow  # the patched variant above runs in the default tier
def test_a_really_full_disk_is_one_error_and_the_rerun_loses_nothing(trainer, saved_run,
                                                                     tmp_path):
    """The same on a real full disk: the workdir is a small tmpfs, and after step 3 a file takes
    every free byte of it (root: mount). The write that fails is the library's own (a metrics
    row, orbax's checkpoint files); one line names the path, the earlier checkpoint is kept, and
    once space is freed the rerun loses nothing."""
    import subprocess

    from hetjax.errors import HetjaxError

    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs")
    _, reference = saved_run
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(disk)],
                             capture_output=True, text=True)
    if mounted.returncode:  # root without the right to mount (a container)
        pytest.skip(f"could not mount a tmpfs: {mounted.stderr.strip()}")
    try:
        fresh(trainer, disk)

        def fill(info):
            if info.step == 3:
                free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
                fd = os.open(disk / "filler", os.O_CREAT | os.O_WRONLY)
                os.posix_fallocate(fd, 0, free)
                os.close(fd)
                assert os.statvfs(disk).f_bavail == 0

        message = _train_expecting(trainer, HetjaxError, trainer.add_hook(fill))
        assert message.startswith("training stopped: ") and message.count("\n") == 0, message
        assert "No space left on device; fix: free space on the disk holding " in message
        assert message.endswith(f"(checkpoint 2 in {disk}/checkpoints is kept)"), message
        os.remove(disk / "filler")
        assert fresh(trainer, disk).train()["resumed_from"] == 2
        assert _losses(disk) == reference
    finally:
        fresh(trainer, tmp_path)  # nothing of the trainer holds a file on the tmpfs
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_torn_last_metrics_line_is_repaired_on_resume(trainer, saved_run, tmp_path, capsys):
    _, reference = saved_run
    fresh(trainer, tmp_path)
    trainer.train(steps=2)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "time": 17')  # killed mid-write
    summary = fresh(trainer, tmp_path).train()
    assert summary["resumed_from"] == 2
    assert capsys.readouterr().err == \
        f"hetjax: {tmp_path}/metrics.jsonl: repaired a torn last line\n"
    assert _losses(tmp_path) == reference


def test_rows_of_a_run_that_left_no_checkpoint_are_not_kept_twice(trainer, saved_run, tmp_path,
                                                                  capsys):
    _, reference = saved_run
    fresh(trainer, tmp_path, **{"checkpoint.every": 0})
    try:
        trainer.train(steps=3)  # then lost: no checkpoint
        fresh(trainer, tmp_path, **{"checkpoint.every": 0}).train()
    finally:
        fresh(trainer, tmp_path, **{"checkpoint.every": 2})
    assert capsys.readouterr().err == (
        f"hetjax: {tmp_path}/metrics.jsonl: dropped 3 rows after step 0 (not in a checkpoint; "
        "trained again now)\n")
    assert _losses(tmp_path) == reference


def test_a_diverging_run_stops_and_saves_nothing_of_it(trainer, tmp_path):
    """A loss far above the run's start (parameters blown up by a hook, as a too-large
    learning rate would) stops the run with an error; no checkpoint of it is written."""
    import jax

    from hetjax.errors import HetjaxError

    fresh(trainer, tmp_path, **{"checkpoint.every": 1})
    step = trainer.step

    def blow_up_in_step_2(*args):  # inside the step, as a DiLoCo outer step would
        metrics = step(*args)
        if int(trainer.state.step) == 2:
            trainer.state = trainer.state.replace(params=jax.tree.map(
                lambda x: x * 30.0, trainer.state.params))
        return metrics

    trainer.step = blow_up_in_step_2
    try:
        message = _train_expecting(trainer, HetjaxError)
        saved = trainer.checkpointer.steps()
    finally:
        del trainer.step
        fresh(trainer, tmp_path, **{"checkpoint.every": 2})
    assert message.startswith("train.max_loss_ratio: the run diverged: step 3's loss "), message
    assert message.endswith(
        f"(limit 4x); training stopped, checkpoint 2, whose parameters gave this loss, was "
        f"removed; nothing after the latest checkpoint was saved (checkpoints in {tmp_path}/"
        "checkpoints); fix: lower train.lr (= 0.003) or train.grad_clip (= 1), then rerun to "
        "resume from the latest checkpoint")
    assert saved == [1]



# (diloco.outer_lr, the error's words between "training stopped, " and the fix)
OUTER_BLOWUPS = [
    (1e30, "train.max_bad_steps: 3 steps in a row (3-5) had a non-finite loss or gradient norm;"
           " training stopped, checkpoint 2, whose parameters gave them, was removed; nothing of"
           " them was saved"),
    pytest.param(1000.0, "train.max_loss_ratio: the run diverged: step 3's loss {loss} is "
                 "{ratio}x its first loss {first} (limit 4x); training stopped, checkpoint 2, "
                 "whose parameters gave this loss, was removed; nothing after the latest "
                 "checkpoint was saved", marks=pytest.mark.slow)]


@pytest.mark.parametrize("outer_lr, stopped", OUTER_BLOWUPS, ids=["non-finite", "diverged"])
def test_a_diloco_outer_lr_that_blows_up_is_blamed_and_leaves_no_checkpoint(tmp_path, outer_lr,
                                                                           stopped):
    """One-process DiLoCo, 2 sites, an exchange and a checkpoint every 2 steps: the outer step
    of step 2 blows the parameters up (to Inf-producing: every later update is skipped; or to a
    finite loss 30x the first). The run stops naming diloco.outer_lr, not train.lr, and no
    checkpoint of the blown-up parameters is left (checkpoint 2 was written after the outer
    step; step 4's, whose update was skipped, is not written)."""
    from hetjax.errors import HetjaxError
    from hetjax.metrics import read_metrics
    from hetjax.train import Trainer

    cfg = tiny_config(**{"topology.nodes": 1, "topology.devices_per_node": 2,
                         "diloco.inner_steps": 2, "diloco.outer_lr": outer_lr,
                         "train.batch_size": 8, "checkpoint.every": 2,
                         "checkpoint.async_save": False, "train.steps": 8,
                         "train.log_every": 1, "workdir": str(tmp_path)})
    trainer = Trainer(cfg, quiet=True)
    with pytest.raises(HetjaxError) as e:
        trainer.train()
    rows = read_metrics(str(tmp_path / "metrics.jsonl"))
    loss, first = rows[2]["loss"], rows[0]["loss"]
    assert str(e.value) == stopped.format(loss=f"{loss:.4g}", ratio=f"{loss / first:.1f}",
                                          first=f"{first:.4g}") + (
        f" (checkpoints in {tmp_path}/checkpoints); fix: lower diloco.outer_lr (= {outer_lr:g})"
        " or diloco.outer_momentum (= 0.9): it came right after the outer step of step 2, then"
        " rerun to resume from the latest checkpoint")
    assert trainer.checkpointer.steps() == []


# --- one run per workdir ------------------------------------------------------------------------
def test_a_workdir_in_use_is_refused_naming_its_holder(tmp_path):
    import socket

    from hetjax.errors import HetjaxError
    from hetjax.lock import WorkdirLock

    holder = subprocess.Popen(["sleep", "60"])
    try:
        with open(tmp_path / "hetjax.lock", "w") as f:
            json.dump({"host": socket.gethostname(), "pid": holder.pid, "started":
                       "2026-01-01 10:00:00 UTC", "command": "hetjax train"}, f)
        with pytest.raises(HetjaxError) as e:
            WorkdirLock(str(tmp_path)).acquire()
        assert str(e.value) == (
            f"{tmp_path} is in use: a hetjax run is running there (pid {holder.pid} on "
            f"{socket.gethostname()}, started 2026-01-01 10:00:00 UTC: hetjax train); fix: wait "
            f"for it to end, use another --config.workdir, or, if that run is gone, delete "
            f"{tmp_path}/hetjax.lock")
    finally:
        holder.kill()
        holder.wait()


def test_a_stale_workdir_lock_is_taken_over_and_released(tmp_path, capsys):
    import socket

    from hetjax.lock import WorkdirLock

    gone = subprocess.Popen(["true"])
    gone.wait()  # its pid is free now
    with open(tmp_path / "hetjax.lock", "w") as f:
        json.dump({"host": socket.gethostname(), "pid": gone.pid, "started": "then"}, f)
    with WorkdirLock(str(tmp_path)) as lock:
        assert lock.holder()["pid"] == os.getpid()
    assert capsys.readouterr().err == (
        f"hetjax: {tmp_path}/hetjax.lock: removing the stale lock of a run that is gone "
        f"(pid {gone.pid} on {socket.gethostname()}, started then: ?)\n")
    assert not os.path.exists(tmp_path / "hetjax.lock")


def test_tilde_and_variables_in_path_fields_are_expanded_once(tmp_path, monkeypatch):
    from hetjax.config import validate

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("RUNS", "runs")
    c = tiny_config(workdir="~/$RUNS/a", **{"checkpoint.dir": "$HOME/ckpt"})
    validate(c)
    assert (c.workdir, c.checkpoint.dir) == (f"{tmp_path}/runs/a", f"{tmp_path}/ckpt")


TINY_CLI = ["--config.model.d_model=64", "--config.model.n_layers=2", "--config.model.d_ff=128",
            "--config.model.max_seq_len=64", "--config.train.seq_len=16",
            "--config.train.batch_size=16", "--config.train.progress=False",
            "--config.data.source=synthetic", "--config.tensorboard=False",
            "--config.train.log_every=1", "--config.eval.every=0"]


@pytest.mark.slow
def test_sigterm_to_hetjax_train_exits_75_with_a_checkpoint(tmp_path):
    from hetjax.metrics import read_metrics

    metrics = tmp_path / "metrics.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "hetjax", "train", *TINY_CLI, "--config.train.steps=100000",
         "--config.checkpoint.every=100000", f"--config.workdir={tmp_path}"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (metrics.exists() and len(read_metrics(str(metrics))) >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=300)
    finally:
        proc.kill()
    last = proc.stderr.read().strip().splitlines()[-1]
    step = int(last.split("after step ")[1].split(":")[0])
    assert rc == 75, last
    assert last == (f"hetjax: preempted (SIGTERM) after step {step}: saved checkpoint {step} in "
                    f"{tmp_path}/checkpoints; rerun the same command to resume (exit code 75)")
    assert os.path.isdir(tmp_path / "checkpoints" / str(step))


@pytest.mark.slow
def test_sigkill_then_rerun_takes_over_the_stale_lock_and_loses_nothing(tmp_path):
    """`hetjax train` killed with SIGKILL (no handler runs: the lock stays, metrics.jsonl
    holds steps past the latest checkpoint); the rerun takes the stale lock over, cuts the
    metrics back and ends with an uninterrupted run's losses."""
    from hetjax.metrics import read_metrics

    def train(workdir, **popen):
        return subprocess.Popen(
            [sys.executable, "-m", "hetjax", "train", *TINY_CLI, "--config.train.steps=6",
             "--config.checkpoint.every=2", "--config.checkpoint.async_save=False",
             f"--config.workdir={workdir}"], cwd=REPO, env={**os.environ, "PYTHONPATH": REPO},
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, **popen)

    reference = train(tmp_path / "reference")
    assert reference.wait(timeout=600) == 0, reference.stderr.read()
    workdir = tmp_path / "killed"
    metrics = workdir / "metrics.jsonl"
    proc = train(workdir)
    try:
        deadline = time.monotonic() + 300
        while not (metrics.exists() and len(read_metrics(str(metrics))) >= 3):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.05)
        proc.kill()
    finally:
        proc.kill()
        proc.wait()
    assert os.path.exists(workdir / "hetjax.lock")
    rerun = train(workdir)
    assert rerun.wait(timeout=600) == 0
    err = rerun.stderr.read()
    assert f"hetjax: {workdir}/hetjax.lock: removing the stale lock of a run that is gone " \
        f"(pid {proc.pid} on " in err, err
    assert _losses(workdir) == _losses(tmp_path / "reference")
    assert not os.path.exists(workdir / "hetjax.lock")


# --- hetjax launch --max-restarts ---------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")
def test_launch_restarts_a_failed_job_up_to_max_restarts(tmp_path):
    import io

    from hetjax import supervise

    marker = tmp_path / "attempts"
    # p1 dies by SIGKILL on the first two attempts (like a lost worker), then succeeds.
    code = (f"import os, pathlib; p = pathlib.Path({str(marker)!r}); n = len(p.read_text()) "
            "if p.exists() else 0; p.write_text('x' * (n + 1)); "
            "os.kill(os.getpid(), 9) if n < 2 else None")
    children = lambda _: [("p0", (sys.executable, "-c", "pass"), None),  # noqa: E731
                        ("p1", (sys.executable, "-c", code), None)]
    out = io.StringIO()
    assert supervise.run_with_restarts(children, grace=1, max_restarts=2, out=out) == 0
    assert marker.read_text() == "xxx"
    restarts = [line for line in out.getvalue().splitlines() if "restarting" in line]
    assert restarts == [
        f"hetjax launch: restarting the job ({k} of --max-restarts 2) after exit code 137; it "
        "resumes from its latest checkpoint" for k in (1, 2)]
    marker.unlink()
    assert supervise.run_with_restarts(children, grace=1, max_restarts=1, out=io.StringIO()) == 137
    # A user error (exit 2) or a preemption (75) is not retried.
    for rc in (2, 75):
        out = io.StringIO()
        once = lambda _, rc=rc: [  # noqa: E731
            ("p0", (sys.executable, "-c", f"raise SystemExit({rc})"), None)]
        assert supervise.run_with_restarts(once, grace=1, max_restarts=3, out=out) == rc
        assert "restarting" not in out.getvalue()


def test_an_elastic_restart_drops_the_failed_host_and_re_plans(tmp_path, capsys):
    from hetjax import config as hconfig
    from hetjax import launch

    argv = ["--local", "4", "--max-restarts", "1", "--elastic", "--config.train.batch_size=24",
            f"--config.workdir={tmp_path}"]
    args, config_args = launch.parser().parse_known_args(argv)
    cfg = hconfig.load_config(None, config_args)
    workers = launch.elastic_workers(cfg, args, config_args, ["p2"])
    assert len(workers) == 3
    topology = hconfig.build_topology(cfg).without_nodes([2])
    assert [(c.name, c.nodes) for c in topology.clusters] == [("ib", 2), ("roce", 1)]
    with open(tmp_path / "elastic_topology.json") as f:
        assert f.read() == topology.to_json(indent=1)
    assert f"--config.topology.file={tmp_path}/elastic_topology.json" in workers[0].argv
    out = capsys.readouterr().out
    assert out.startswith("hetjax launch: --elastic: dropped p2; re-planned on 6 devices:\n")
    import re

    pp, dp, tp = map(int, re.search(r"plan \(planner\): pp=(\d+) dp=(\d+) tp=(\d+)", out).groups())
    assert pp * dp * tp == 6
    # A second failure (p0 of the three) leaves the roce node alone with its cluster.
    assert len(launch.elastic_workers(cfg, args, config_args, ["p2", "p0"])) == 2


# --- a hung worker is named, not the healthy peer that noticed -------------------------------
def _beating_children(tmp_path):
    """Two children that beat like workers (`start_heartbeat`) and wait; each writes its pid."""
    code = ("import os, sys, time; from hetjax.worker import start_heartbeat; start_heartbeat(); "
            f"open(os.path.join({str(tmp_path)!r}, sys.argv[1] + '.pid'), 'w')"
            ".write(str(os.getpid())); time.sleep(120)")
    env = {**os.environ, "PYTHONPATH": REPO, "HETJAX_HEARTBEAT": "1"}
    return [(name, (sys.executable, "-c", code, name), env) for name in ("p0", "p1")]


def _launch_in_thread(tmp_path, **kw):
    import io
    import threading

    from hetjax import supervise

    out, failed, result = io.StringIO(), [], []
    thread = threading.Thread(target=lambda: result.append(supervise.run(
        _beating_children(tmp_path), grace=1, out=out, failed=failed, **kw)))
    thread.start()
    deadline = time.monotonic() + 120
    pids = {}
    while len(pids) < 2:
        assert time.monotonic() < deadline, out.getvalue()
        for name in ("p0", "p1"):
            path = tmp_path / f"{name}.pid"
            if path.exists() and path.read_text():
                pids[name] = int(path.read_text())
        time.sleep(0.2)
    return thread, out, failed, result, pids


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")
def test_a_stopped_worker_is_blamed_not_the_peer_that_aborted(tmp_path):
    """`kill -STOP` p1; p0 then aborts (as JAX's heartbeat check does in the healthy
    coordinator): the launcher names p1, so --elastic drops p1's host."""
    thread, out, failed, result, pids = _launch_in_thread(tmp_path)
    os.kill(pids["p1"], signal.SIGSTOP)
    time.sleep(6)  # > STALLED_AFTER_S: p1's heartbeat is stale, p0's fresh
    os.kill(pids["p0"], signal.SIGABRT)
    thread.join(timeout=60)
    log = out.getvalue()
    assert result == [1] and failed == ["p1"], log
    assert "hetjax launch: failed: p1 stopped making progress first" in log
    stop = [line for line in log.splitlines() if "stopped making progress (no heartbeat" in line]
    assert len(stop) == 1 and stop[0].startswith(
        f"hetjax launch: p1 (pid {pids['p1']}) stopped making progress (no heartbeat for "), log
    assert stop[0].endswith(", then p0 was killed by SIGABRT; stopping p1"), log


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")
def test_a_stopped_worker_stops_the_job_after_the_heartbeat_timeout(tmp_path):
    thread, out, failed, result, pids = _launch_in_thread(tmp_path, hang_timeout=5)
    os.kill(pids["p1"], signal.SIGSTOP)
    thread.join(timeout=60)
    log = out.getvalue()
    assert result == [1] and failed == ["p1"], log
    assert f"hetjax launch: p1 (pid {pids['p1']}) stopped making progress: no heartbeat for " \
        in log and "(--heartbeat-timeout 5); stopping p0, p1" in log, log



def test_heartbeats_of_srun_tasks_are_read_from_their_labels():
    """srun carries every task's output in one stream, each line after its `--label`: the
    launcher takes each task's heartbeat from it, names the task that stopped beating (p1),
    and joins again a line a heartbeat cut before its newline."""
    import io

    from hetjax import supervise

    code = ("import sys, time\n"
            "w = sys.stderr.write\n"
            "w('0: training' + '\\n'); w('0: cut <hetjax heartbeat>' + '\\n'); w('0: ' + '\\n')\n"
            "for i in range(60):\n"
            "    w('0: <hetjax heartbeat>\\n' + ('1: <hetjax heartbeat>\\n' if i < 2 else ''))\n"
            "    sys.stderr.flush(); time.sleep(0.5)\n")
    out, failed = io.StringIO(), []
    rc = supervise.run([("srun", (sys.executable, "-c", code), None)], grace=1, out=out,
                    failed=failed, hang_timeout=3, labelled=True)
    log = out.getvalue()
    assert rc == 1 and failed == ["p1"], log
    assert "hetjax launch: p1 (srun task 1) stopped making progress: no heartbeat for " in log
    assert "[srun] 0: training\n[srun] 0: cut \n" in log and "heartbeat>" not in log, log


class _FakeKeyValueStore:
    """jax.distributed's key-value client as `hetjax.stopping` uses it, in memory."""

    def __init__(self):
        import threading

        self.values, self.changed = {}, threading.Condition()

    def key_value_set(self, key, value, allow_overwrite=False):
        with self.changed:
            assert allow_overwrite or key not in self.values, key
            self.values[key] = value
            self.changed.notify_all()

    def blocking_key_value_get(self, key, timeout_in_ms):
        with self.changed:
            if not self.changed.wait_for(lambda: key in self.values, timeout_in_ms / 1e3):
                raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")
            return self.values[key]


def _stop_flags(monkeypatch, n: int, answering: int, start: int):
    """`answering` StopFlags of an `n`-process job at step `start`, on one fake store."""
    import jax
    from jax._src import distributed

    from hetjax import stopping

    store = _FakeKeyValueStore()
    monkeypatch.setattr(distributed.global_state, "client", store)
    monkeypatch.setattr(jax, "process_count", lambda: n)
    flags = []
    for me in range(answering):
        monkeypatch.setattr(jax, "process_index", lambda me=me: me)
        stopping._generation[0] = 0  # each process counts its own train() calls
        flags.append(stopping.StopFlag(start))
    return flags


def test_the_processes_agree_on_the_step_after_the_furthest_one(monkeypatch):
    """Process 1 hears the stop (the launcher's line) while process 0 is a step ahead: both
    stop at the step after the furthest process's, so neither has passed it."""
    flags = _stop_flags(monkeypatch, n=2, answering=2, start=5)
    try:
        assert not flags[0].due(7) and not flags[1].due(6)
        flags[1].request("SIGINT")
        deadline = time.monotonic() + 10
        while not all(flag.stop_step for flag in flags):  # the daemon threads answer
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert [flag.stop_step for flag in flags] == [8, 8]
        assert not flags[1].due(7) and flags[1].due(8) and flags[0].due(8)
        assert flags[0].signal == flags[1].signal == "SIGINT"
    finally:
        for flag in reversed(flags):  # each put back the handler the one before it set
            flag.restore()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_process_that_never_answers_ends_the_wait_with_no_agreement(monkeypatch):
    from hetjax.stopping import NoAgreement

    monkeypatch.setenv("HETJAX_HEARTBEAT_TIMEOUT", "1")
    flags = _stop_flags(monkeypatch, n=3, answering=2, start=0)  # process 2 is stopped
    try:
        flags[0].request("SIGINT")
        deadline = time.monotonic() + 10
        with pytest.raises(NoAgreement, match="not every process answered the stop request "
                                              "within 1 s"):
            for step in range(1, 10**6):  # until its daemon thread has heard the request
                assert not flags[1].due(step) and time.monotonic() < deadline
                time.sleep(0.01)
    finally:
        for flag in reversed(flags):  # each put back the handler the one before it set
            flag.restore()

@pytest.mark.parametrize("sig, word, rc", [(signal.SIGINT, "interrupted", 130),
                                           (signal.SIGTERM, "preempted", 75)],
                         ids=["SIGINT", "SIGTERM"])
def test_the_launcher_passes_ctrl_c_and_sigterm_on_as_a_stop_line(tmp_path, sig, word, rc):
    """`supervise.run` in its own process, two children that answer the stop line as workers do
    (save, exit 130 for Ctrl-C, 75 for SIGTERM): the launcher tells both, waits for them and
    exits with their code; nothing is counted as a failure."""
    import threading

    child = ("import sys; print('ready', flush=True); line = sys.stdin.readline(); "
             "print('got', line.strip(), flush=True); "
             "raise SystemExit(75 if 'SIGTERM' in line else 130)")
    code = ("import sys; from hetjax import supervise; sys.exit(supervise.run([(n, (sys.executable, "
            f"'-c', {child!r}), None) for n in ('p0', 'p1')], grace=5))")
    launcher = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE,
                                env={**os.environ, "PYTHONPATH": REPO}, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(launcher.stdout.readline, "")))
    reader.start()
    try:
        deadline = time.monotonic() + 60
        while sum(line.endswith("] ready\n") for line in lines) < 2:
            assert time.monotonic() < deadline and launcher.poll() is None, lines
            time.sleep(0.05)
        launcher.send_signal(sig)
        assert launcher.wait(timeout=60) == rc, lines
    finally:
        launcher.kill()
        reader.join()
    how = "interrupted" if sig == signal.SIGINT else "preempted (SIGTERM)"
    assert f"hetjax launch: {how}: asking p0, p1 to save the step they agree on and stop" \
        in "".join(lines)
    assert sorted(line for line in lines if "] got " in line) == [
        f"[p{i}] got hetjax: stop {sig.name}\n" for i in (0, 1)]
    assert lines[-1] == (f"hetjax launch: {word}; the workers stopped as they said above; rerun "
                         "the same command to resume\n")
    assert not any("failed" in line for line in lines)

def _launched(args: list[str], cwd=REPO, path: str | None = None):
    """`hetjax launch *args` in the background: (process, its output lines so far)."""
    import threading

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = REPO
    if path:
        env["PATH"] = path + os.pathsep + env["PATH"]
    proc = subprocess.Popen([sys.executable, "-m", "hetjax", "launch", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")),
                     daemon=True).start()
    return proc, lines


def _wait_for_rows(proc, lines, metrics, n: int, timeout: float = 300) -> None:
    from hetjax.metrics import read_metrics

    deadline = time.monotonic() + timeout
    while not (metrics.exists() and len(read_metrics(str(metrics))) >= n):
        assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
        time.sleep(0.1)


# The launched jobs' model: tiny, on the default topology's 8 CPU devices (2 processes x 4).
LAUNCH_TINY = ["--config.model.d_model=32", "--config.model.n_layers=2",
               "--config.model.n_heads=4", "--config.model.n_kv_heads=2",
               "--config.model.d_ff=64", "--config.model.max_seq_len=64",
               "--config.train.seq_len=16", "--config.train.batch_size=16",
               "--config.train.warmup_steps=1", "--config.train.log_every=1",
               "--config.train.progress=False", "--config.data.source=synthetic",
               "--config.tensorboard=False", "--config.parallel.pp=1", "--config.parallel.dp=0",
               "--config.parallel.tp=1", "--config.train.microbatches=1", "--config.eval.every=0"]

FAKE_SSH = """#!/bin/sh
# A stand-in for ssh: run the remote command (the last argument) on this machine.
for last; do :; done
exec sh -c "$last"
"""


@pytest.mark.slow
def test_a_worker_stopped_over_ssh_is_named_and_dropped_by_elastic(tmp_path):
    """`hetjax launch --hostfile` through an ssh on PATH that runs the command here; after
    training has begun, `kill -STOP` p1 (its whole remote session, as a frozen host). The
    launcher reads the heartbeats from ssh's stderr, names p1 (not p0, whose JAX heartbeat
    check aborts it), and --elastic restarts without p1's host; the run completes."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text(FAKE_SSH)
    (bin_dir / "ssh").chmod(0o755)
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1\nlocalhost\n")
    workdir = tmp_path / "run"
    from test_launch import free_port

    proc, lines = _launched(
        ["--hostfile", str(hosts), "--port", str(free_port()), "--max-restarts", "1",
         "--elastic", "--heartbeat-timeout", "10", "--grace", "2", "--timeout", "400",
         *LAUNCH_TINY, "--config.train.steps=24", "--config.checkpoint.every=2",
         f"--config.workdir={workdir}"], path=str(bin_dir))
    try:
        _wait_for_rows(proc, lines, workdir / "metrics.jsonl", 2)
        started = next(line for line in lines if line.startswith("hetjax launch: started p1 "))
        p1 = int(started.split("(pid ")[1].rstrip(")\n"))
        os.killpg(p1, signal.SIGSTOP)  # ssh and the worker it runs: that host froze
        rc = proc.wait(timeout=500)
    finally:
        proc.kill()
    log = "".join(lines)
    assert rc == 0, log[-6000:]
    assert f"hetjax launch: p1 (pid {p1}) stopped making progress" in log, log[-6000:]
    assert "hetjax launch: failed: p1 stopped making progress first" in log
    assert "hetjax launch: --elastic: dropped p1; re-planned on 4 devices" in log
    assert "dropped p0" not in log and "failed: p0" not in log
    from hetjax.metrics import read_metrics

    assert [r["step"] for r in read_metrics(str(workdir / "metrics.jsonl"))] == list(
        range(1, 25))


@pytest.mark.slow
@pytest.mark.parametrize("target, sig", [("launcher", signal.SIGINT), ("workers", signal.SIGTERM)],
                         ids=["ctrl-c-to-the-launcher", "sigterm-to-every-worker"])
def test_ctrl_c_to_a_launch_saves_every_worker_and_the_rerun_loses_nothing(tmp_path, target,
                                                                           sig):
    """SIGINT to `hetjax launch --local 2` (what Ctrl-C sends it), or SIGTERM to both workers
    themselves (what a scheduler sends every task when it preempts the job): both workers agree
    on a step, save it and exit (130, 75; with `checkpoint.every=0`, nothing else is saved);
    the rerun resumes from it, and the losses equal an uninterrupted run's."""
    import re

    from hetjax.metrics import read_metrics

    args = ["--local", "2", "--timeout", "400", *LAUNCH_TINY, "--config.train.steps=12",
            "--config.checkpoint.every=0"]
    reference, lines = _launched([*args, f"--config.workdir={tmp_path / 'reference'}"])
    assert reference.wait(timeout=500) == 0, "".join(lines)
    workdir = tmp_path / "run"
    proc, lines = _launched([*args, f"--config.workdir={workdir}"])
    try:
        _wait_for_rows(proc, lines, workdir / "metrics.jsonl", 2)
        if target == "launcher":
            proc.send_signal(sig)
        else:
            for pid in re.findall(r"hetjax launch: started p\d \(pid (\d+)\)", "".join(lines)):
                os.kill(int(pid), sig)
        rc = proc.wait(timeout=300)
    finally:
        proc.kill()
    log = "".join(lines)
    assert rc == (130 if sig == signal.SIGINT else 75), log[-6000:]
    how = "interrupted (SIGINT)" if sig == signal.SIGINT else "preempted (SIGTERM)"
    saved = [line for line in lines if f"hetjax: {how} after step " in line]
    assert len(saved) == 2, log[-6000:]  # both workers
    step = int(saved[0].split("after step ")[1].split(":")[0])
    assert all(f"saved checkpoint {step} in {workdir}/checkpoints" in line for line in saved)
    assert step < 12 and sorted(os.listdir(workdir / "checkpoints")) == [str(step), "tokenizer"]
    if target == "launcher":
        assert "hetjax launch: interrupted: asking p0, p1 to save the step they agree on" in log
    else:
        assert re.search(r"hetjax launch: p[01] was preempted \(SIGTERM\) and saved", log), log
        assert "failed" not in log and "restarting" not in log
    rerun, lines = _launched([*args, f"--config.workdir={workdir}"])
    assert rerun.wait(timeout=500) == 0, "".join(lines)
    assert any(f"resumed from checkpoint {step}" in line for line in lines), "".join(lines)
    ours = [r["loss"] for r in read_metrics(str(workdir / "metrics.jsonl"))]
    want = [r["loss"] for r in read_metrics(str(tmp_path / "reference" / "metrics.jsonl"))]
    assert len(ours) == 12 and ours == pytest.approx(want, rel=1e-6)


# (how the run stopped, what hetjax does, the test): the table "Never lose a run" in
# docs/reliability.md (`python tests/test_reliability.py` prints it). Each test ends with a
# run whose losses equal an uninterrupted run's.
NEVER_LOSE = [
    ("SIGTERM, any `checkpoint.every` (also 0)",
     "saves the current step, exit 75; the rerun restores whatever checkpoint the directory "
     "holds", "test_sigterm_without_periodic_checkpoints_resumes_from_its_save"),
    ("SIGINT (Ctrl-C)",
     "the same, as `interrupted (SIGINT) after step N: saved checkpoint N ...`, exit 130",
     "test_sigint_saves_the_current_step_and_exits_130"),
    ("a second Ctrl-C",
     "stops at once without saving and names the lost steps: `interrupted (second SIGINT) "
     "after step 3, without saving: steps 3-3 are lost; rerun the same command to resume from "
     "checkpoint 2 (exit code 130)`",
     "test_a_second_sigint_stops_at_once_and_names_the_lost_steps"),
    ("Ctrl-C or SIGTERM at `hetjax launch`, or SIGTERM to every worker (a scheduler's "
     "preemption; several processes)",
     "the launcher writes a stop line on every worker's stdin (ssh carries it too), or each "
     "worker hears the signal itself; the workers agree on a step, each saves it (`[p0] hetjax: "
     "interrupted (SIGINT) after step 4: saved checkpoint 4 in ...`) and exits 130 (75 for "
     "SIGTERM), and so does the launcher, which waits for them rather than stopping them; a "
     "second Ctrl-C stops them at once",
     "test_ctrl_c_to_a_launch_saves_every_worker_and_the_rerun_loses_nothing"),
    ("SIGKILL",
     "nothing runs; the rerun takes the stale workdir lock over, cuts metrics.jsonl back to the "
     "checkpoint and trains on",
     "test_sigkill_then_rerun_takes_over_the_stale_lock_and_loses_nothing"),
    ("a full disk (ENOSPC writing a metrics row or a checkpoint)",
     "one line, `training stopped: <path>: No space left on device; fix: free space on the disk "
     "holding <path> (or choose a path on another disk); then rerun the same command to resume "
     "(checkpoint 2 in ... is kept)`; a save still in flight is drained without a second "
     "traceback (also on a real full tmpfs: test_a_really_full_disk_is_one_error_and_the_rerun_"
     "loses_nothing, root, slow)", "test_a_full_disk_is_one_error_and_the_rerun_loses_nothing"),
    ("killed while writing a metrics row",
     "the torn last line is dropped on resume (`repaired a torn last line`)",
     "test_a_torn_last_metrics_line_is_repaired_on_resume"),
]


def never_lose_table() -> str:
    rows = ["| how the run stopped | what hetjax does | test |", "|---|---|---|"]
    for how, what, test in NEVER_LOSE:
        marks = getattr(globals()[test], "pytestmark", [])
        cases = [len(m.args[1]) for m in marks if m.name == "parametrize"]
        note = (f" ({cases[0]} cases)" if cases else "") + (
            " (slow)" if any(m.name == "slow" for m in marks) else "")
        rows.append(f"| {how} | {what} | {test}{note} |")
    return "\n".join(rows)


def test_the_never_lose_table_in_the_docs_is_generated_from_its_tests():
    with open(os.path.join(REPO, "docs", "reliability.md")) as f:
        assert never_lose_table() in f.read()  # and every test it names exists


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
    print()
    print(never_lose_table())
