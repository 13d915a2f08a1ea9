"""Tests for the emulated cluster (hetjax.testbed) and its checks (hetjax.linkcheck).

The pure parts (address layout, tc command lines, CPU quotas, error messages, the socket
protocol over loopback) run anywhere. Tests marked `root` build real namespaces and are skipped,
with the reason, when not root or when the kernel lacks what the testbed needs.
"""

import os
import re
import signal
import socket
import subprocess
import sys
import threading

import pytest

from hetjax import cli, linkcheck
from hetjax import testbed as tbm
from hetjax.errors import HetjaxError
from hetjax.core.topology import ClusterLink, Link, Topology, cpu_hybrid, hethub_mixed, make_cluster

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def three_clusters(**override) -> Topology:
    """ib (2 nodes) and roce and eth (1 node each); ib <-> eth is a slow 1 Gb/s WAN."""
    return Topology(
        name="three",
        clusters=(make_cluster("ib", 2, 1, "a100", "infiniband"),
                  make_cluster("roce", 1, 1, "ascend910b", "roce"),
                  make_cluster("eth", 1, 1, "v100", "ethernet")),
        inter_cluster=Link("ethernet", 25.0, 50.0),
        cluster_links=(ClusterLink("ib", "eth", Link("ethernet", 1.0, 5000.0)),), **override)


# --- layout ---------------------------------------------------------------------------------------
def test_layout_gives_each_cluster_its_own_subnet():
    hosts = tbm.layout(three_clusters(), "ab12")
    assert [(h.name, h.address, h.cluster, h.node) for h in hosts] == [
        ("ib-0", "10.77.0.1", 0, 0), ("ib-1", "10.77.0.2", 0, 1),
        ("roce-0", "10.77.1.1", 1, 0), ("eth-0", "10.77.2.1", 2, 0)]
    assert [h.netns for h in hosts] == [f"hjtb-ab12-h{i}" for i in range(4)]
    assert [tbm.cluster_subnet(i) for i in range(3)] == [
        "10.77.0.0/24", "10.77.1.0/24", "10.77.2.0/24"]
    assert tbm.hosts_file(hosts).splitlines()[2:] == [
        "10.77.0.1 ib-0", "10.77.0.2 ib-1", "10.77.1.1 roce-0", "10.77.2.1 eth-0"]


def test_hostnames_are_cleaned_and_fall_back_to_indices_on_a_clash():
    topo = Topology("t", (make_cluster("Fast_A100", 1, 1, "a100", "infiniband"),
                          make_cluster("slow", 1, 1, "v100", "ethernet")),
                    Link("ethernet", 25.0, 50.0))
    assert [h.name for h in tbm.layout(topo, "x")] == ["fast-a100-0", "slow-0"]
    clash = Topology("t", (make_cluster("a_b", 1, 1, "a100", "infiniband"),
                           make_cluster("a-b", 1, 1, "v100", "ethernet")),
                     Link("ethernet", 25.0, 50.0))
    assert [h.name for h in tbm.layout(clash, "x")] == ["c0-0", "c1-0"]


def test_a_topology_too_big_to_emulate_is_refused():
    with pytest.raises(HetjaxError, match=r"100 nodes.*at most 64.*topology.nodes"):
        tbm.layout(cpu_hybrid(nodes=50), "x")


# --- shaping --------------------------------------------------------------------------------------
def test_rates_are_scaled_by_one_factor_per_destination_cluster():
    topo = three_clusters()
    ib = tbm.egress_classes(topo, 0, scale=0.002)
    assert [(c.classid, c.subnet, c.link.kind, c.rate_bps) for c in ib] == [
        ("1:1", "10.77.0.0/24", "infiniband", 400_000_000),  # own cluster: the NIC
        ("1:2", "10.77.1.0/24", "ethernet", 50_000_000),  # the inter-cluster default
        ("1:3", "10.77.2.0/24", "ethernet", 2_000_000)]  # the ib <-> eth override
    eth = tbm.egress_classes(topo, 2, scale=0.002)
    assert [c.rate_bps for c in eth] == [2_000_000, 50_000_000, 50_000_000]  # override both ways
    # Another factor scales every class alike.
    assert [c.rate_bps for c in tbm.egress_classes(topo, 0, scale=0.004)] == [
        800_000_000, 100_000_000, 4_000_000]


def test_tc_commands_shape_each_destination_subnet():
    topo = three_clusters()
    host = tbm.layout(topo, "ab12")[2]  # roce-0
    cmds = tbm.tc_commands(host, tbm.egress_classes(topo, host.cluster, 0.002))
    assert all(c[:3] == ["tc", "-n", "hjtb-ab12-h2"] for c in cmds)
    lines = [" ".join(c[3:]) for c in cmds]
    assert lines[0] == "qdisc add dev eth0 root handle 1: htb"
    assert lines[1] == ("class add dev eth0 parent 1: classid 1:1 htb rate 50000000bit "
                        "ceil 50000000bit burst 65536 cburst 65536 quantum 60000")
    assert lines[2] == ("filter add dev eth0 parent 1: protocol ip prio 1 u32 "
                        "match ip dst 10.77.0.0/24 flowid 1:1")
    # the own-cluster class at the RoCE NIC rate, with a burst of 1 ms of traffic
    assert "classid 1:2 htb rate 400000000bit ceil 400000000bit burst 65536" in lines[3]
    assert lines[6].endswith("match ip dst 10.77.2.0/24 flowid 1:3")
    assert len(cmds) == 1 + 2 * 3
    fast = tbm.EgressClass("1:1", 0, "10.77.0.0/24", Link("infiniband", 1000.0, 1.0), 2 * 10**9)
    assert "burst 250000 cburst 250000" in " ".join(tbm.tc_commands(host, [fast])[1])


def test_scale_and_rates_outside_what_shaping_can_do_are_refused():
    topo = three_clusters()
    with pytest.raises(HetjaxError, match=r"scale must be in \(0, 1\]"):
        tbm.egress_classes(topo, 0, scale=0)
    with pytest.raises(HetjaxError, match=r"infiniband.*40000 Mbit/s.*scale <= 0.02"):
        tbm.egress_classes(topo, 0, scale=0.2)
    with pytest.raises(HetjaxError, match=r"ethernet link \(1 Gb/s\).*0.1 Mbit/s.*scale >= 0.001"):
        tbm.egress_classes(topo, 0, scale=0.0001)


# --- CPU quotas -----------------------------------------------------------------------------------
def test_cpu_quotas_follow_peak_tflops_or_are_given_per_cluster():
    topo = three_clusters()  # a100 312, ascend910b 320, v100 125 TFLOPS
    assert tbm.cpu_quotas(topo, None) == {}
    q = tbm.cpu_quotas(topo, 1.0)
    assert q[1] == 1.0  # the fastest kind gets the whole budget
    assert q[0] == pytest.approx(312 / 320) and q[2] == pytest.approx(125 / 320)
    assert tbm.cpu_quotas(topo, {"roce": 0.5}) == {1: 0.5}  # others run uncapped
    assert tbm.cpu_quotas(cpu_hybrid(), 0.5) == {0: 0.5, 1: 0.5}
    assert tbm.cpu_quotas(hethub_mixed(), 2.0)[0] == pytest.approx(2.0 * 312 / 320)


def test_cpu_quota_errors_say_what_to_change():
    with pytest.raises(HetjaxError, match=r"\['gpu'\].*clusters are \['ib', 'roce', 'eth'\]"):
        tbm.cpu_quotas(three_clusters(), {"gpu": 1.0})
    with pytest.raises(HetjaxError, match=r"'eth' would get 0.0078.*at least 0.01"):
        tbm.cpu_quotas(three_clusters(), 0.02)  # 0.02 * 125 / 320 TFLOPS
    assert tbm.parse_cpus("1.5") == 1.5
    assert tbm.parse_cpus("ib:1,roce:0.5") == {"ib": 1.0, "roce": 0.5}
    with pytest.raises(HetjaxError, match="--cpus=ib:1,roce:0.5"):
        tbm.parse_cpus("ib=1")


# --- running inside a host ------------------------------------------------------------------------
def test_host_command_enters_the_namespaces_and_execs_the_argv():
    host = tbm.layout(cpu_hybrid(nodes=1), "ab12")[1]
    cmd = tbm.host_command(host, ["python", "-c", "print(1)"], "/tmp/hjtb-ab12/hosts",
                           "/sys/fs/cgroup/cpu/hjtb-ab12/roce-0/cgroup.procs")
    assert cmd[:6] == ["nsenter", "--net=/run/netns/hjtb-ab12-h1", "unshare", "--uts",
                       "--mount", "--"]
    assert cmd[-3:] == ["python", "-c", "print(1)"]
    assert cmd[8].split(" && ") == [
        "echo $$ > /sys/fs/cgroup/cpu/hjtb-ab12/roce-0/cgroup.procs",
        "printf %s roce-0 > /proc/sys/kernel/hostname",
        "mount --bind /tmp/hjtb-ab12/hosts /etc/hosts", 'exec "$@"']
    assert "cgroup" not in tbm.host_command(host, ["true"], "/h")[8]
    with pytest.raises(HetjaxError, match="needs a command"):
        tbm.host_command(host, [], "/h")


def test_processes_in_hosts_import_this_checkout_of_hetjax():
    path = tbm._hetjax_pythonpath(os.pathsep.join(["/elsewhere", REPO]))
    assert path.split(os.pathsep) == [REPO, "/elsewhere"]


def test_a_testbed_that_is_not_up_refuses_to_run_and_names_its_hosts():
    tb = tbm.Testbed(cpu_hybrid(nodes=1))
    assert [h.name for h in tb.hosts] == ["ib-0", "roce-0"]
    assert tb.address("roce-0") == "10.77.1.1" and tb.host(0).name == "ib-0"
    with pytest.raises(HetjaxError, match=r"no host 'gpu-0'.*\['ib-0', 'roce-0'\]"):
        tb.host("gpu-0")
    with pytest.raises(HetjaxError, match="not up"):
        tb.run("ib-0", ["true"])
    tb.close()  # closing what was never started is harmless


# --- launching training across the hosts ----------------------------------------------------------
def test_rsh_script_runs_a_command_in_each_named_host():
    hosts = tbm.layout(cpu_hybrid(nodes=1), "ab12")
    wrappers = {h.name: tbm.host_command(h, ["sh", "-c"], "/tmp/hjtb-ab12/hosts") for h in hosts}
    text = tbm.rsh_script("ab12", wrappers, "/src/hetjax")
    lines = text.splitlines()
    assert lines[0] == "#!/bin/sh"
    assert "PYTHONPATH=/src/hetjax${PYTHONPATH:+:$PYTHONPATH}" in lines
    ib = next(line for line in lines if line.strip().startswith("ib-0)"))
    assert "--net=/run/netns/hjtb-ab12-h0" in ib and ib.endswith('sh -c "$2" ;;')
    assert "printf %s ib-0 > /proc/sys/kernel/hostname" in ib
    roce = next(line for line in lines if line.strip().startswith("roce-0)"))
    assert "hjtb-ab12-h1" in roce
    assert "has no host $1; its hosts are ib-0 roce-0" in text


def test_rsh_script_executes_in_a_shell(tmp_path):
    """The script's shell syntax, with `env` standing in for the namespace wrapper."""
    script = tmp_path / "rsh"
    script.write_text(tbm.rsh_script("x", {"h-0": ["sh", "-c"]}, "/src/hetjax"))
    script.chmod(0o755)
    out = subprocess.run([str(script), "h-0", 'echo "$PYTHONPATH" ok'], capture_output=True,
                         text=True, env={"PATH": os.environ["PATH"], "PYTHONPATH": "/other"})
    assert out.stdout.split() == ["/src/hetjax:/other", "ok"]
    bad = subprocess.run([str(script), "h-9", "true"], capture_output=True, text=True)
    assert bad.returncode == 2 and "no host h-9" in bad.stderr


def test_hostfile_lists_hosts_in_process_order():
    hosts = tbm.layout(cpu_hybrid(nodes=2, devices_per_node=1), "ab12")
    assert tbm.hostfile_text(hosts).split() == ["ib-0", "ib-1", "roce-0", "roce-1"]
    swapped = ["ib-0", "roce-0", "ib-1", "roce-1"]
    assert tbm.hostfile_text(hosts, swapped).split() == swapped
    for bad in (["ib-0", "ib-1", "roce-0"], ["ib-0", "ib-0", "roce-0", "roce-1"],
                ["ib-0", "ib-1", "roce-0", "gpu-0"]):
        with pytest.raises(HetjaxError, match="each of the hosts"):
            tbm.hostfile_text(hosts, bad)
    with pytest.raises(HetjaxError, match="not up"):
        tbm.Testbed(cpu_hybrid(nodes=1)).launch_args()


def test_traffic_is_summed_per_link_class_in_both_directions():
    tb = tbm.Testbed(three_clusters())
    traffic = {"ib-0": {0: 100, 1: 10, 2: 1}, "ib-1": {0: 200, 1: 0, 2: 0},
               "roce-0": {0: 20, 1: 0, 2: 5}, "eth-0": {0: 2, 1: 0, 2: 0}}
    assert linkcheck.traffic_by_link(tb, traffic) == {
        "ib": 300, "ib <-> roce": 30, "ib <-> eth": 3, "roce": 0, "roce <-> eth": 5, "eth": 0}
    text = linkcheck.format_traffic(tb, {"ib-0": {0: 2**20, 1: 2**21, 2: 0}})
    assert re.search(r"ib \(infiniband\)\s+1.00 MiB\s+\(shaped to 400 Mbit/s\)", text)
    assert re.search(r"ib <-> roce \(ethernet\)\s+2.00 MiB\s+\(shaped to 50 Mbit/s\)", text)


def test_a_training_run_reports_its_timed_steps():
    rows = ({"step": 1, "loss": 5.9, "compile_and_step_s": 9.0},
            {"step": 2, "loss": 5.8, "step_s": 0.7}, {"step": 3, "loss": 5.7, "step_s": 0.5},
            {"step": 4, "loss": 5.6, "step_s": 0.6})
    run = tbm.TrainingRun(0, 12.0, rows, {}, "line 1\nline 2\n")
    assert run.ok and run.step_times() == [0.5, 0.6] and run.step_times(0) == [0.7, 0.5, 0.6]
    assert run.error() == "line 1\nline 2"
    assert not tbm.TrainingRun(1, 1.0, rows, {}, "").ok
    assert not tbm.TrainingRun(0, 1.0, rows[:1], {}, "").ok


# --- refusing early -------------------------------------------------------------------------------
def test_not_root_is_refused_with_the_fix(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(HetjaxError, match=r"needs root.*sudo hetjax testbed"):
        tbm.check_environment()
    with pytest.raises(HetjaxError, match="needs root"):
        tbm.cleanup()


def test_missing_tools_and_qdiscs_are_named(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(tbm.shutil, "which", lambda t: None if t == "tc" else f"/usr/bin/{t}")
    with pytest.raises(HetjaxError, match=r"`tc` command; install iproute2"):
        tbm.check_environment()
    monkeypatch.setattr(tbm.shutil, "which", lambda t: f"/usr/bin/{t}")
    calls = []

    def fake_run(cmd, check=True):
        calls.append(cmd)
        failed = cmd[0] == "tc" and "htb" in cmd and "qdisc" in cmd
        err = "Error: Specified qdisc kind is unknown." if failed else ""
        return subprocess.CompletedProcess(cmd, 2 if failed else 0, "", err)

    monkeypatch.setattr(tbm, "_run", fake_run)
    with pytest.raises(HetjaxError, match=r"lacks the htb qdisc \(CONFIG_NET_SCH_HTB\).*unknown"):
        tbm.check_environment()
    assert calls[-1][:3] == ["ip", "netns", "del"]  # the probe namespace is removed


def test_missing_cgroup_controller_is_named(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(tbm.shutil, "which", lambda t: f"/usr/bin/{t}")
    monkeypatch.setattr(tbm, "_run", lambda cmd, check=True: subprocess.CompletedProcess(cmd, 0))
    monkeypatch.setattr(tbm, "CGROUP_CPU", str(tmp_path / "cpu"))
    tbm.check_environment(cgroups=False)
    with pytest.raises(HetjaxError, match=r"cgroup v1 cpu controller.*without CPU quotas"):
        tbm.check_environment(cgroups=True)


# --- checks: pure parts and the socket protocol ---------------------------------------------------
def test_link_pairs_cover_every_link_class_that_hosts_can_exercise():
    tb = tbm.Testbed(three_clusters())
    pairs = [(label, a.name, b.name, c.rate_bps) for label, a, b, c in linkcheck.link_pairs(tb)]
    assert pairs == [("ib", "ib-0", "ib-1", 400_000_000),  # one-node clusters have no intra pair
                     ("ib -> roce", "ib-0", "roce-0", 50_000_000),
                     ("ib -> eth", "ib-0", "eth-0", 2_000_000),
                     ("roce -> eth", "roce-0", "eth-0", 50_000_000)]
    a, b = linkcheck.smoke_hosts(tb)
    assert (a.name, b.name) == ("ib-0", "roce-0")
    with pytest.raises(HetjaxError, match="needs two emulated hosts"):
        linkcheck.smoke_hosts(tbm.Testbed(Topology(
            "one", (make_cluster("c", 1, 1, "cpu", "ethernet"),), Link("ethernet", 25.0, 50.0))))


def test_socket_measurement_protocol_over_loopback():
    with socket.socket() as s:  # a free port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    got = {}
    server = threading.Thread(target=lambda: got.update(linkcheck.recv("127.0.0.1", port)))
    server.start()
    report = linkcheck.send("127.0.0.1", port, 3 << 20, rounds=5)
    server.join()
    assert report["bytes"] == got["bytes"] == 3 << 20
    assert report["rate_bps"] > 0 and report["rtt_s"] > 0


def test_format_table_shows_configured_measured_and_latency():
    m = linkcheck.LinkMeasurement("ib -> roce", "ib-0", "roce-0", Link("ethernet", 25.0, 50.0),
                                  50e6, 47.5e6, 1 << 20, 0.0002)
    assert m.ratio == pytest.approx(0.95)
    row = linkcheck.format_table([m], 0.002).splitlines()[1]
    assert re.search(r"ib -> roce \(ethernet\)\s+50.0 Mbit/s\s+47.5 Mbit/s\s+0.95\s+50 us / 100 us",
                     row)


# --- CLI ------------------------------------------------------------------------------------------
def test_cli_testbed_help_and_errors(capsys, monkeypatch):
    assert cli.main(["hetjax", "testbed", "--help"]) == 0
    assert "up|measure|smoke|run|down" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        cli.main(["hetjax", "testbed", "bogus"])
    assert e.value.code == 2
    assert cli.main(["hetjax", "testbed", "measure", "--cpus=gpu:1"]) == 2
    assert "clusters are ['ib', 'roce']" in capsys.readouterr().err
    assert cli.main(["hetjax", "testbed", "measure", "--scale=0.5"]) == 2
    assert "scale <= 0.02" in capsys.readouterr().err
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert cli.main(["hetjax", "testbed", "measure"]) == 2
    assert "needs root" in capsys.readouterr().err


# --- on the real kernel (root) --------------------------------------------------------------------
def _testbed_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "the testbed needs root (network namespaces, tc, cgroups)"
    try:
        tbm.check_environment(cgroups=True)
    except HetjaxError as e:
        return str(e)
    return None


_UNAVAILABLE = _testbed_unavailable()
needs_testbed = pytest.mark.skipif(_UNAVAILABLE is not None, reason=str(_UNAVAILABLE))


def _nothing_left(run_id: str) -> None:
    assert tbm.leftovers(run_id) == []
    assert not any(name.startswith("hjtb-") for name in tbm._root_links())


@pytest.mark.root
@needs_testbed
def test_two_hosts_run_a_psum_across_the_shaped_link_and_leave_nothing():
    topo = cpu_hybrid(nodes=1, devices_per_node=1)  # 2 clusters x 1 node
    with tbm.Testbed(topo, cpus={"roce": 0.5}) as tb:
        run_id = tb.run_id
        assert len(tbm.leftovers(run_id)) == 3 + 1 + 1  # 2 hosts + switch, cgroup, state dir
        # Each host has its own hostname, resolving to its own address.
        p = tb.run("roce-0", [sys.executable, "-c", "import socket; h = socket.gethostname(); "
                              "print(h, socket.gethostbyname(h), socket.gethostbyname('ib-0'))"],
                   stdout=subprocess.PIPE, text=True)
        assert p.communicate(timeout=30)[0].split() == ["roce-0", "10.77.1.1", "10.77.0.1"]
        sleeper = tb.run("ib-0", ["sleep", "600"])
        result = linkcheck.psum_smoke(tb)
        assert result.ok, result.outputs
        assert [o["value"] for o in result.outputs] == [3.0, 3.0]
        assert result.hosts == ("ib-0", "roce-0") and result.link.kind == "ethernet"
        assert result.crossed_shaped_link, result.traffic  # >= 4 MiB through each class
    assert sleeper.poll() is not None  # processes started in hosts are stopped
    _nothing_left(run_id)


@pytest.mark.root
@needs_testbed
# Both slow (a two-process training each); the default tier brings the testbed up and down.
@pytest.mark.parametrize("executor", [pytest.param("spmd", marks=pytest.mark.slow),
                                      pytest.param("mpmd", marks=pytest.mark.slow)])
def test_a_two_process_training_runs_through_the_launcher_across_the_shaped_link(tmp_path,
                                                                                 executor):
    """`hetjax launch` with one `hetjax train` worker per emulated host: a tiny pp = 2 job
    whose stages sit in different clusters, so its activations cross the shaped link. With
    the MPMD executor each cluster is a JAX world of its own and the activations cross on the
    bridge, whose addresses are the hosts' names (resolved inside their namespaces)."""
    topo = cpu_hybrid(nodes=1, devices_per_node=1)  # ib-0 and roce-0
    config = [f"--config.{k}={v}" for k, v in {
        "topology.preset": "cpu_hybrid", "topology.nodes": 1, "topology.devices_per_node": 1,
        "parallel.pp": 2, "parallel.tp": 1, "model.d_model": 32, "model.n_layers": 2,
        "model.n_heads": 4, "model.n_kv_heads": 2, "model.d_ff": 64, "model.max_seq_len": 16,
        "train.seq_len": 16, "train.batch_size": 8, "train.microbatches": 2,
        "train.steps": 3, "train.log_every": 1, "train.progress": False,
        "data.source": "synthetic", "tensorboard": False, "checkpoint.every": 0,
        "eval.every": 0, "pipeline.executor": executor}.items()]
    with tbm.Testbed(topo) as tb:
        run_id = tb.run_id
        run = tb.train(config, str(tmp_path / "run"), timeout=150)
        assert run.ok, run.output[-3000:]
        assert ("worlds: 2" in run.output) == (executor == "mpmd")
        # Process i runs on the emulated host of topology node i, named in the hostfile.
        assert "0        ib-0" in run.output and "1        roce-0" in run.output
        assert "[p0] summary" in run.output and "[p1] summary" not in run.output
    assert [m["step"] for m in run.metrics] == [1, 2, 3]
    assert all(0 < m["loss"] < 10 for m in run.metrics)
    # Each direction carried at least the activations of 3 steps x 2 micro-batches (4 x 16 x
    # 32 fp32 values each) through the shaped inter-cluster class.
    acts = 3 * 2 * 4 * 16 * 32 * 4
    assert run.traffic["ib-0"][1] > acts and run.traffic["roce-0"][0] > acts, run.traffic
    _nothing_left(run_id)


@pytest.mark.root
@needs_testbed
def test_measured_rates_follow_the_configured_link_classes():
    topo = Topology("ib2-roce1", (make_cluster("ib", 2, 1, "cpu", "infiniband"),
                                  make_cluster("roce", 1, 1, "cpu", "roce")),
                    Link("ethernet", 25.0, 50.0))
    with tbm.Testbed(topo) as tb:  # ib 400 Mbit/s, ib -> roce 50 Mbit/s
        ms = {m.label: m for m in tb.measure_links(seconds=0.4)}
        run_id = tb.run_id
    assert set(ms) == {"ib", "ib -> roce"}
    assert ms["ib -> roce"].measured_bps < ms["ib"].measured_bps
    for m in ms.values():  # loose: 2 shared cores, and TCP/IP headers count against the rate
        assert 0.5 <= m.ratio <= 1.3, linkcheck.format_table(list(ms.values()), tb.scale)
    _nothing_left(run_id)


@pytest.mark.root
@needs_testbed
def test_cpu_quota_throttles_the_processes_of_a_host():
    with tbm.Testbed(cpu_hybrid(nodes=1), cpus={"ib": 0.1}) as tb:
        busy = "import time\nt = time.time()\nwhile time.time() - t < 0.5: pass\n" \
               "print(open('/proc/self/cgroup').read())"
        p = tb.run("ib-0", [sys.executable, "-c", busy], stdout=subprocess.PIPE, text=True)
        out = p.communicate(timeout=30)[0]
        assert f":cpu:/hjtb-{tb.run_id}/ib-0" in out
        with open(os.path.join(tbm.CGROUP_CPU, f"hjtb-{tb.run_id}", "ib-0", "cpu.stat")) as f:
            stat = dict(line.split() for line in f)
        assert int(stat["nr_throttled"]) > 0
        run_id = tb.run_id
    _nothing_left(run_id)


@pytest.mark.root
@needs_testbed
def test_teardown_on_error():
    with pytest.raises(RuntimeError, match="boom"):
        with tbm.Testbed(cpu_hybrid(nodes=1), cpus=1.0) as tb:
            run_id = tb.run_id
            p = tb.run("ib-0", ["sleep", "600"])
            raise RuntimeError("boom")
    assert p.poll() is not None
    _nothing_left(run_id)


def _start_up_command(sigint_ignored=False):
    """`testbed up` in a child; with sigint_ignored it starts with SIGINT ignored, as a
    background job (or a test runner's worker's child) does."""
    argv = [sys.executable, "-m", "hetjax", "testbed", "up", "--cpus=1",
            "--config.topology.nodes=1"]
    if sigint_ignored:  # exec keeps an ignored signal ignored
        argv = ["sh", "-c", 'trap "" INT; exec "$@"', "sh", *argv]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run_id = None
    for line in p.stdout:
        run_id = run_id or (re.match(r"testbed (\w+):", line) or [None, None])[1]
        if "is up" in line:
            return p, run_id
    raise AssertionError(f"`hetjax testbed up` did not come up (exit {p.wait()})")


@pytest.mark.root
@needs_testbed
@pytest.mark.parametrize("sig,sigint_ignored", [(signal.SIGTERM, False), (signal.SIGINT, False),
                                                (signal.SIGINT, True)])
def test_up_tears_down_on_a_signal(sig, sigint_ignored):
    p, run_id = _start_up_command(sigint_ignored)
    try:
        assert tbm.leftovers(run_id)
        p.send_signal(sig)
        assert p.wait(timeout=30) == 130
    finally:  # a failed test must not leave its testbed up
        if p.poll() is None:
            p.kill()
            p.wait()
            tbm.cleanup()
        p.stdout.close()
    _nothing_left(run_id)


@pytest.mark.root
@needs_testbed
def test_down_removes_what_a_killed_run_left():
    p, run_id = _start_up_command()
    p.kill()  # no chance to clean up
    p.wait()
    p.stdout.close()
    assert tbm.leftovers(run_id)
    removed, _ = tbm.cleanup()
    assert run_id in removed
    _nothing_left(run_id)
