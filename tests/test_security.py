"""Hostile input to what hetjax runs: host names, paths, config overrides and topology values
that reach ssh's or srun's command line. A fake `ssh` on PATH parses its options as OpenSSH
does (also after the destination, and `-o ProxyCommand=...` runs a command) and runs the
remote command with `sh -c`, as the remote shell would; a fake `srun` runs its program once
per task. Every injection attempt writes a marker file; none may appear."""

from __future__ import annotations

import json
import os
import sys

import pytest

from hetjax import config as hconfig
from hetjax import launch
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


@pytest.mark.parametrize("line", ["-oProxyCommand=touch {pwned}/host", "localhost touch {pwned}/host;",
                                  "$(touch {pwned}/host)", "-- localhost", "host;touch {pwned}/host"])
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
    assert launch.expand_nodelist("gpu[007-008],login1") == ["gpu007", "gpu008", "login1"]
    for bad in ("-oProxyCommand=x", "a b", "$(x)"):
        with pytest.raises(HetjaxError, match="is not a host name"):
            launch.expand_nodelist(f"gpu1,{bad}")
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
    overrides = [f"--config.wandb.name={v}" for v in _injections(pwned)[3:]]
    workdir = f"{tmp_path}/run {_injections(pwned)[0]}"
    assert launch.main(["--hostfile", str(hostfile), "--python", python, "--chdir", str(chdir),
                        "--grace", "1", "--timeout", "60", "--config.data.source=synthetic",
                        f"--config.topology.file={topo_file}", f"--config.workdir={workdir}",
                        overrides[-1]]) == 0
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
