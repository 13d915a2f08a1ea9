"""Hostile input to what hetjax runs: host names, paths, config overrides and topology values
that reach ssh's or srun's command line. A fake `ssh` on PATH parses its options as OpenSSH
does (also after the destination, and `-o ProxyCommand=...` runs a command) and runs the
remote command with `sh -c`, as the remote shell would; a fake `srun` runs its program once
per task. Every injection attempt writes a marker file; none may appear."""

from __future__ import annotations

import json
import os
import re
import sys

import pytest

from hetjax import config as hconfig
from hetjax import launch
from hetjax.worker import expand_nodelist
from hetjax.errors import HetjaxError

FAKE_SSH = """#!{python}
# OpenSSH's command line: options, the destination, options again, then the remote command,
# whose words are joined with blanks and run by the remote user's shell.
import subprocess, sys

WITH_VALUE = set("BbcDEeFIiJLlmOoPpQRSWw")


def options(args):
    while args and args[0].startswith("-") and args[0] != "-":
        arg = args.pop(0)
        if arg == "--":
            break
        letters = arg[1:]
        while letters:
            c, letters = letters[0], letters[1:]
            if c in WITH_VALUE:
                value, letters = letters or args.pop(0), ""
                key, _, command = value.partition("=")
                if c == "o" and key.lower() == "proxycommand":
                    subprocess.run(["sh", "-c", command])
    return args


args = options(sys.argv[1:])
host = args.pop(0)
args = options(args)
sys.exit(subprocess.run(["sh", "-c", " ".join(args)]).returncode)
"""

FAKE_SRUN = """#!{python}
# srun's command line: its own options, then the program and its arguments, run once per task.
import os, subprocess, sys

args = sys.argv[1:]
ntasks = 1
while args and args[0].startswith("-"):
    arg = args.pop(0)
    if arg.startswith("--ntasks="):
        ntasks = int(arg.split("=", 1)[1])
rc = 0
for task in range(ntasks):
    rc = max(rc, subprocess.run(args, env={{**os.environ, "SLURM_PROCID": str(task)}}).returncode)
sys.exit(rc)
"""

# What every worker runs in place of python: it records where it ran and its arguments.
FAKE_PYTHON = """#!/bin/sh
n=${HETJAX_PROCESS_ID:-$SLURM_PROCID}
pwd > "$RECORD/worker$n"
printf '%s\\n' "$@" >> "$RECORD/worker$n"
"""


def _script(path, text: str):
    path.write_text(text.format(python=sys.executable) if "{python}" in text else text)
    path.chmod(0o755)
    return str(path)


@pytest.fixture
def fakes(tmp_path, monkeypatch):
    """A bin directory with the fake ssh and srun first on PATH, a fake python, the marker
    directory injected commands would write to, and the record of what the workers got."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _script(bin_dir / "ssh", FAKE_SSH)
    _script(bin_dir / "srun", FAKE_SRUN)
    python = _script(tmp_path / "python", FAKE_PYTHON)
    record = tmp_path / "record"
    record.mkdir()
    pwned = tmp_path / "pwned"
    pwned.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("RECORD", str(record))
    for c in "ABCDEF":
        monkeypatch.setenv(f"PWNED_{c}", str(pwned / c))
    return python, record, pwned


def _injections(pwned) -> list[str]:
    """Ways to run `touch` hidden in a value; each writes its own marker, named by a variable
    (`fakes` sets them), so the value holds no '/' and can name a directory too."""
    return ['$(touch "$PWNED_A")', '`touch "$PWNED_B"`', 'x; touch "$PWNED_C"',
            'x && touch "$PWNED_D"', '\'; touch "$PWNED_E"; \'', 'x\ntouch "$PWNED_F"']


@pytest.mark.parametrize("line", ["-oProxyCommand=touch {pwned}/host",
                                  "localhost touch {pwned}/host;", "$(touch {pwned}/host)",
                                  "-- localhost", "host;touch {pwned}/host"])
def test_a_hostfile_line_that_is_not_a_host_name_is_refused_before_anything_runs(
        tmp_path, fakes, line):
    python, record, pwned = fakes
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"127.0.0.1\n{line.format(pwned=pwned)}\n")
    with pytest.raises(HetjaxError, match=r"line 2: .* is not a host name"):
        launch.main(["--hostfile", str(hostfile), "--python", python, "--grace", "1",
                     "--timeout", "60", "--config.data.source=synthetic"])
    assert os.listdir(pwned) == [] and os.listdir(record) == []


def test_slurm_node_lists_and_coordinators_are_host_names_only():
    assert expand_nodelist("gpu[007-008],login1") == ["gpu007", "gpu008", "login1"]
    for bad in ("-oProxyCommand=x", "a b", "$(x)"):
        with pytest.raises(HetjaxError, match="is not a host name"):
            expand_nodelist(f"gpu1,{bad}")
    with pytest.raises(HetjaxError, match="--coordinator: '-oProxyCommand=x' is not a host name"):
        launch.main(["--hostfile", "/nonexistent", "--coordinator=-oProxyCommand=x:1234",
                     "--config.data.source=synthetic"])


def test_an_rsh_template_gets_the_host_as_one_word():
    assert launch.rsh_argv("ssh -p 2222 -l me {host}", "node1") == [
        "ssh", "-p", "2222", "-l", "me", "node1"]
    assert launch.rsh_argv("ssh -o BatchMode=yes me@{host}", "node1") == [
        "ssh", "-o", "BatchMode=yes", "me@node1"]


def test_no_injected_command_runs_over_ssh(tmp_path, fakes):
    """Paths, config overrides and topology values full of shell syntax reach the workers as
    the same bytes, through a real (parsing, `sh -c`-running) ssh command line."""
    python, record, pwned = fakes
    hostfile = tmp_path / "hosts"
    hostfile.write_text("127.0.0.1\nlocalhost\n")
    chdir = tmp_path / f"dir {_injections(pwned)[0]}"
    chdir.mkdir()
    topo = json.loads(hconfig.build_topology(hconfig.base_config()).to_json())
    topo["clusters"][0]["nic_settings"]["socket_ifname"] = _injections(pwned)[2]
    topo["clusters"][1]["nic_settings"]["hcas"] = [_injections(pwned)[1]]
    topo_file = tmp_path / "topo.json"
    topo_file.write_text(json.dumps(topo))
    common = ["--hostfile", str(hostfile), "--python", python, "--chdir", str(chdir), "--grace",
              "1", "--timeout", "60", "--config.data.source=synthetic"]
    # Environment values from the topology are names, never shell text: refused at the file.
    with pytest.raises(HetjaxError, match="is not a network interface name"):
        launch.main([*common, f"--config.topology.file={topo_file}"])
    overrides = [f"--config.wandb.name={v}" for v in _injections(pwned)[3:]]
    workdir = f"{tmp_path}/run {_injections(pwned)[0]}"
    assert launch.main([*common, f"--config.workdir={workdir}", overrides[-1]]) == 0
    assert os.listdir(pwned) == []
    for n in (0, 1):
        got = (record / f"worker{n}").read_text().split("\n")
        assert got[0] == str(chdir)
        assert f"--config.workdir={workdir}" in got and overrides[-1].split("\n")[0] in got


def test_no_injected_command_runs_under_srun(tmp_path, fakes, monkeypatch):
    python, record, pwned = fakes
    monkeypatch.setenv("SLURM_JOB_ID", "1")
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "2")
    workdir = f"{tmp_path}/run {_injections(pwned)[2]}"
    assert launch.main(["--slurm", "--python", python, "--grace", "1", "--timeout", "60",
                        "--config.data.source=synthetic", f"--config.workdir={workdir}",
                        f"--config.wandb.name={_injections(pwned)[0]}"]) == 0
    assert os.listdir(pwned) == []
    got = (record / "worker1").read_text().split("\n")
    assert f"--config.workdir={workdir}" in got
    assert f"--config.wandb.name={_injections(pwned)[0]}" in got


# --- safetensors files people download ------------------------------------------------------------
def _safetensors_dir(tmp_path):
    """A one-file checkpoint of two small tensors, and its path."""
    import numpy as np

    from hetjax.interop.safetensors_files import write_file

    d = tmp_path / "model"
    d.mkdir()
    write_file(str(d / "model.safetensors"), {"a": np.arange(6, dtype=np.float32).reshape(2, 3),
                                              "b": np.ones(4, np.float32)})
    return d


def _rewrite(path, header: dict | bytes, data: bytes = b"\0" * 40, length: int | None = None):
    import struct

    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob) if length is None else length) + blob + data)


GOOD = {"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
        "b": {"dtype": "F32", "shape": [4], "data_offsets": [24, 40]}}
BAD_HEADERS = {
    "a header length past the end": (GOOD, 1 << 62, "header length is 4611686018427387904"),
    "a header that is not JSON": (b"{not json", None, "header is not JSON"),
    "a header that is a list": ([1, 2], None, "header is a JSON list"),
    "an unknown dtype": ({**GOOD, "b": {**GOOD["b"], "dtype": "F99"}}, None, "dtype 'F99'"),
    "a shape larger than its bytes": (
        {**GOOD, "a": {**GOOD["a"], "shape": [1 << 20, 1 << 20]}}, None, "has 4398046511104 bytes"),
    "a negative dimension": ({**GOOD, "a": {**GOOD["a"], "shape": [-2, -3]}}, None,
                             "shape [-2, -3]"),
    "offsets past the file's end": (
        {**GOOD, "b": {"dtype": "F32", "shape": [4], "data_offsets": [1 << 40, (1 << 40) + 16]}},
        None, "not [begin, end] inside the 40 data bytes"),
    "offsets that overlap": ({**GOOD, "b": {**GOOD["b"], "data_offsets": [8, 24]}}, None,
                             "share data bytes"),
    "metadata that is not strings": ({**GOOD, "__metadata__": {"x": [1]}}, None,
                                     "__metadata__ is not an object of strings"),
    "an entry without data_offsets": ({**GOOD, "b": {"dtype": "F32", "shape": [4]}}, None,
                                      "not an object of dtype, shape and data_offsets"),
}


@pytest.mark.parametrize("case", list(BAD_HEADERS))
def test_a_damaged_or_hostile_safetensors_header_is_one_error(tmp_path, case):
    from hetjax.interop.safetensors_files import SafetensorsDir

    d = _safetensors_dir(tmp_path)
    assert SafetensorsDir(str(d)).read("a", (slice(1, 2),)).tolist() == [[3.0, 4.0, 5.0]]
    header, length, message = BAD_HEADERS[case]
    _rewrite(d / "model.safetensors", header, length=length)
    with pytest.raises(HetjaxError, match=re.escape(message)) as e:
        SafetensorsDir(str(d)).read("a")
    assert str(d / "model.safetensors") in str(e.value)
    assert "not a valid safetensors file" in str(e.value)


@pytest.mark.parametrize("shard", ["../outside.safetensors", "{outside}", "link.safetensors"])
def test_an_index_names_only_files_inside_the_model_directory(tmp_path, shard):
    from hetjax.interop.safetensors_files import SafetensorsDir, write_file

    import numpy as np

    d = _safetensors_dir(tmp_path)
    outside = tmp_path / "outside.safetensors"
    write_file(str(outside), {"secret": np.ones(2, np.float32)})
    (d / "link.safetensors").symlink_to(outside)
    shard = shard.format(outside=outside)
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"secret": shard, "a": "model.safetensors"}}))
    with pytest.raises(HetjaxError, match=f"names the file '{re.escape(shard)}', which is not "
                                          "inside"):
        SafetensorsDir(str(d))


def test_an_index_naming_a_tensor_its_shard_lacks_is_one_error(tmp_path):
    from hetjax.interop.safetensors_files import SafetensorsDir

    d = _safetensors_dir(tmp_path)
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model.safetensors", "c": "model.safetensors"}}))
    with pytest.raises(HetjaxError, match="names model.safetensors for tensor 'c', which that "
                                          "file does not hold"):
        SafetensorsDir(str(d))


def test_tensors_the_model_does_not_use_are_named(tmp_path):
    """An HF checkpoint with tensors hetjax's model has no place for (a rotary buffer older
    transformers saved, a head beside tied embeddings) loads, and says which it left out."""
    import shutil

    import numpy as np

    from hetjax.interop import hf_checkpoint
    from hetjax.interop.safetensors_files import write_file
    from test_interop import fixture, load_single

    d = tmp_path / "llama"
    shutil.copytree(fixture("llama_gqa"), d)
    write_file(str(d / "extra.safetensors"),
               {"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(4, np.float32),
                "model.vision_tower.weight": np.ones(2, np.float32)})
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"].update({"model.layers.0.self_attn.rotary_emb.inv_freq": "extra.safetensors",
                                "model.vision_tower.weight": "extra.safetensors"})
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    seen = {}
    real = hf_checkpoint.load_params

    def spy(*a, **k):
        params, st = real(*a, **k)
        seen["st"] = st
        return params, st

    hf_checkpoint.load_params = spy
    try:
        load_single(str(d))
    finally:
        hf_checkpoint.load_params = real
    assert seen["st"].unused == ["model.layers.0.self_attn.rotary_emb.inv_freq",
                                 "model.vision_tower.weight"]
    assert hf_checkpoint.unused_message(seen["st"]) == (
        f"hetjax: warning: model.init_from: 2 tensor(s) of {d} are not part of this model and "
        "were not loaded: model.layers.0.self_attn.rotary_emb.inv_freq, model.vision_tower.weight")


# --- config.json: bounded before anything is allocated ------------------------------------------
def _llama(**change) -> dict:
    from hetjax.core.hf_config import PRESETS

    hf = dict(PRESETS["llama3_1_8b"], rope_scaling=dict(PRESETS["llama3_1_8b"]["rope_scaling"]))
    for k, v in change.items():
        if v is None:
            hf.pop(k, None)
        else:
            hf[k] = v
    return hf


@pytest.mark.parametrize("change,message", [
    (dict(vocab_size=10 ** 12), "config.json vocab_size: 1000000000000 is not an integer >= 1 "
                                "up to 4,194,304"),
    (dict(num_hidden_layers=10 ** 6), "config.json num_hidden_layers: 1000000 is not an integer"),
    (dict(hidden_size="4096"), "config.json hidden_size: '4096' is not an integer"),
    (dict(intermediate_size=-1), "config.json intermediate_size: -1 is not an integer"),
    (dict(num_attention_heads=None), "config.json num_attention_heads: is missing"),
    (dict(max_position_embeddings=1e300), "config.json max_position_embeddings: 1e+300"),
    (dict(rope_theta=float("nan")), "config.json rope_theta: nan is not a number > 0"),
    (dict(rope_scaling=dict(rope_type="llama3", factor=8.0, high_freq_factor=4.0,
                            original_max_position_embeddings=8192)),
     "config.json rope_scaling.low_freq_factor: is missing; llama3 RoPE scaling needs factor, "
     "low_freq_factor, high_freq_factor, original_max_position_embeddings"),
    (dict(rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                            high_freq_factor=4.0, original_max_position_embeddings=10 ** 9)),
     "config.json rope_scaling.original_max_position_embeddings: 1000000000 is not"),
    (dict(rope_scaling="yes"), "config.json rope_scaling: 'yes' is not an object"),
])
def test_config_json_values_are_bounded_before_anything_is_allocated(change, message):
    from hetjax.errors import ConfigError
    from hetjax.core.hf_config import model_fields

    with pytest.raises(ConfigError, match=re.escape(message)) as e:
        model_fields(_llama(**change), "model.init_from")
    assert str(e.value).startswith("config.model.init_from: config.json ")


def test_a_huge_config_json_is_one_error_from_the_cli(tmp_path):
    """`hetjax train --config.model.init_from=DIR` with a vocabulary of 10^12: exit 2 and one
    message, before any weight is read or allocated."""
    import subprocess

    from conftest import REPO

    (tmp_path / "config.json").write_text(json.dumps(_llama(vocab_size=10 ** 12)))
    p = subprocess.run([sys.executable, "-m", "hetjax", "train",
                        f"--config.model.init_from={tmp_path}"], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2, p.stderr[-3000:]
    assert p.stderr.strip().splitlines()[0] == (
        "hetjax: error: config.model.init_from: config.json vocab_size: 1000000000000 is not an "
        "integer >= 1 up to 4,194,304"), p.stderr


def test_model_shape_overrides_are_bounded():
    from hetjax.config import load_config, validate

    for field, value in (("vocab_size", 10 ** 12), ("n_layers", 10 ** 6), ("d_ff", 1 << 40)):
        with pytest.raises(HetjaxError, match=rf"config.model.{field}: must be in \["):
            validate(load_config(None, [f"--config.model.{field}={value}"]))


# --- nothing hetjax writes lands outside the directories named ------------------------------------
def test_an_export_replaces_links_in_its_directory_rather_than_writing_through_them(tmp_path):
    """An export directory holding symbolic links at the names an export writes (as a
    downloaded model directory may): the links are replaced by the export's files and the
    files they pointed to stay as they were."""
    from hetjax.interop import hf_checkpoint
    from test_interop import fixture, load_single
    from test_tokenizer import write_hf_tokenizer

    m, params = load_single(fixture("llama_gqa"))
    victims = tmp_path / "elsewhere"
    victims.mkdir()
    out = tmp_path / "export"
    out.mkdir()
    names = ["config.json", "model.safetensors", "tokenizer.json",
             "model.safetensors.index.json", "model-00001-of-00007.safetensors"]
    for name in names:
        (victims / name).write_text("precious\n")
        (out / name).symlink_to(victims / name)
    tok = write_hf_tokenizer(tmp_path / "tok")
    written = set()
    for shard in (1 << 40, 1 << 17):  # one file, then shards and an index
        written.update(hf_checkpoint.write_hf(str(out), jax_params(params), m,
                                              tokenizer_files={"tokenizer.json": str(tok)},
                                              max_shard_bytes=shard))
    assert set(names) <= written, written
    assert all((victims / n).read_text() == "precious\n" for n in names)
    assert not any((out / n).is_symlink() for n in names)
    assert json.loads((out / "config.json").read_text())["vocab_size"] == m.vocab_size


def jax_params(params):
    import jax

    return jax.device_get(params)


def test_a_saved_tokenizer_names_only_a_file_beside_it(tmp_path):
    from hetjax.tokenizer import SAVED, load_tokenizer
    from test_tokenizer import write_tiktoken

    write_tiktoken(tmp_path / "outside.tiktoken")
    saved = tmp_path / "run" / "checkpoints" / "tokenizer"
    saved.mkdir(parents=True)
    tok = load_tokenizer(str(tmp_path / "outside.tiktoken"), "false")
    for file in ("../../../outside.tiktoken", str(tmp_path / "outside.tiktoken")):
        (saved / SAVED).write_text(json.dumps({
            "kind": "tiktoken", "file": file, "add_bos": False, "bos_id": None, "eos_id": None,
            "vocab_size": tok.vocab_size, "fingerprint": tok.fingerprint}))
        with pytest.raises(HetjaxError, match=f"names the file '{re.escape(file)}', which is "
                                              "not inside"):
            load_tokenizer(str(saved))


def test_links_planted_in_a_workdir_are_never_written_through(tmp_path):
    """A workdir where someone left links at the names a run writes (plan.json, config.json,
    topology.json; metrics.jsonl, which a run appends to and cuts): the run files replace
    their links; the metrics file, kept in place, is refused as a link, naming it."""
    from types import SimpleNamespace

    from hetjax.metrics import MetricsWriter, truncate_metrics
    from hetjax.planner import plan_from_config
    from hetjax.train import Trainer

    victims, workdir = tmp_path / "elsewhere", tmp_path / "run"
    victims.mkdir()
    workdir.mkdir()
    names = ["plan.json", "topology.json", "config.json", "metrics.jsonl"]
    for name in names:
        (victims / name).write_text('{"step": 1}\n')
        (workdir / name).symlink_to(victims / name)
    c = hconfig.base_config()
    topology = hconfig.build_topology(c)
    Trainer._write_run_files(SimpleNamespace(workdir=str(workdir), config=c, topology=topology,
                                             plan=plan_from_config(c, topology)))
    assert json.loads((workdir / "plan.json").read_text())
    for opened in (lambda: MetricsWriter(str(workdir), tensorboard=False),
                   lambda: truncate_metrics(str(workdir / "metrics.jsonl"), 0)):
        with pytest.raises(OSError) as e:
            opened()
        assert e.value.filename == str(workdir / "metrics.jsonl")
        assert e.value.strerror == "is a symbolic link, which hetjax does not write through"
    assert all((victims / n).read_text() == '{"step": 1}\n' for n in names)
    assert [n for n in names if (workdir / n).is_symlink()] == ["metrics.jsonl"]
