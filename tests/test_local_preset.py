"""The `local` topology preset (hetjax/core/local_preset.py): the devices JAX sees, the catalogue
lookup of their kind, the message for an unknown kind, and the MFU mismatch warning."""

import jax
import pytest

from hetjax import config as hconfig
from hetjax.core.catalogue import ACCELERATORS, accelerator_for_kind
from hetjax.errors import ConfigError, TopologyError
from hetjax.core.local_preset import (LocalDevice, describe_jax_devices, device_mismatch,
                                 topology_from_devices)
from hetjax.core.topology import preset
from tests.conftest import tiny_config


def test_local_preset_is_the_eight_simulated_cpu_devices():
    t = preset("local")
    assert t.num_devices == len(jax.devices()) == 8
    assert [c.accelerator.name for c in t.clusters] == ["cpu"]
    assert t.num_nodes == jax.process_count() == 1
    assert t.default_compute_dtype == "float32"  # the CPU default stays float32
    assert device_mismatch(t, describe_jax_devices(jax.devices())) is None


def test_local_preset_from_the_config_and_its_stated_peak():
    c = tiny_config(**{"topology.preset": "local", "topology.peak_tflops": 0.5})
    t = hconfig.build_topology(c)
    assert t.clusters[0].accelerator.peak_tflops == 0.5
    assert t.clusters[0].accelerator.memory_gib == ACCELERATORS["cpu"].memory_gib
    with pytest.raises(ConfigError, match="topology.peak_tflops"):
        hconfig.build_topology(tiny_config(**{"topology.peak_tflops": 1.0}))  # cpu_hybrid


@pytest.mark.parametrize("kind,name", [
    ("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100_sxm"),
    ("NVIDIA H100 PCIe", "h100_pcie"), ("NVIDIA A100-SXM4-40GB", "a100_40gb"),
    ("NVIDIA A100-SXM4-80GB", "a100_80gb"), ("NVIDIA L40S", "l40s"),
    ("AMD Instinct MI300X", "mi300x"), ("TPU v4", "tpu_v4"), ("TPU v5 lite", "tpu_v5e"),
    ("TPU v5p", "tpu_v5p"), ("TPU v6 lite", "tpu_v6e"), ("cpu", "cpu"),
    ("Tesla V100-SXM2-16GB", "v100_16gb"), ("Tesla V100-SXM2-32GB", "v100"), ("Tesla T4", "t4"),
    ("NVIDIA GeForce RTX 4090", "rtx_4090"), ("NVIDIA GeForce RTX 3090", "rtx_3090"),
    ("NVIDIA GeForce RTX 2080 Ti", "rtx_2080_ti"), ("NVIDIA TITAN RTX", "titan_rtx"),
    ("NVIDIA L4", "l4"), ("NVIDIA A10", "a10"), ("NVIDIA A40", "a40"),
    ("NVIDIA A800-SXM4-80GB", "a800"), ("NVIDIA H800", "h800"),
    ("AMD Instinct MI250X", "mi250x_gcd"),  # JAX's device is one of its two dies
    ("NVIDIA A10G", None)])  # not in the catalogue: the local preset asks for its figures
def test_device_kinds_map_to_catalogue_entries(kind, name):
    assert accelerator_for_kind(kind) == name


def test_processes_become_nodes_and_the_runtime_memory_wins():
    devs = [LocalDevice("NVIDIA H100 80GB HBM3", i // 8, "gpu", 80 * 2**30) for i in range(16)]
    t = topology_from_devices(devs)
    (cl,) = t.clusters
    assert (cl.nodes, cl.devices_per_node) == (2, 8)
    assert cl.accelerator.peak_tflops == 989.0 and cl.accelerator.memory_gib == 80.0
    assert cl.nic.kind == "infiniband" and cl.intra_node.kind == "nvlink"
    assert t.default_compute_dtype == "bfloat16"  # accelerators: bf16 compute


def test_unknown_device_kind_says_how_to_state_its_peak():
    with pytest.raises(TopologyError, match=r"'Acme X1' is not in the hardware catalogue.*"
                       r"topology.peak_tflops=.*topology.memory_gib="):
        topology_from_devices([LocalDevice("Acme X1", 0, "gpu")])
    acc = topology_from_devices([LocalDevice("Acme X1", 0, "gpu")], 400.0, 24.0) \
        .clusters[0].accelerator
    assert (acc.name, acc.peak_tflops, acc.memory_gib) == ("acme_x1", 400.0, 24.0)


def test_mfu_warns_when_the_topology_is_not_the_devices_jax_sees():
    devs = describe_jax_devices(jax.devices())
    assert device_mismatch(preset("cpu_hybrid"), devs) is None  # 8 simulated CPUs
    kind = device_mismatch(preset("holmes_hybrid", nodes=1, devices_per_node=4), devs)
    assert "a100" in kind and "8 x cpu" in kind and "topology.preset=local" in kind
    count = device_mismatch(preset("cpu_single", devices_per_node=4), devs)
    assert "4 x cpu" in count and "8 x cpu" in count


def test_the_trainer_prints_the_mfu_warning_in_its_summary():
    from hetjax.train import Trainer, format_summary

    c = tiny_config(**{"topology.preset": "cpu_single", "topology.devices_per_node": 2})
    trainer = Trainer(c, quiet=True)  # builds nothing on the devices until it trains
    assert "2 x cpu" in trainer.mfu_warning and "8 x cpu" in trainer.mfu_warning
    summary = {"steps": 2, "first_loss": 5.9, "final_loss": 5.8, "tokens_per_s": 1e3,
               "mfu": 1.47, "mfu_warning": trainer.mfu_warning, "compile_and_first_step_s": 1.0,
               "wall_s": 2.0, "metrics": "metrics.jsonl"}
    line = next(x for x in format_summary(summary).splitlines() if "MFU" in x)
    assert "147.00% of the topology's peak (warning: MFU is measured against" in line
    assert Trainer(tiny_config(), quiet=True).mfu_warning is None  # cpu_hybrid: 8 CPUs
