"""The catalogue of nominal hardware: link classes, accelerator kinds, NIC settings, and
`make_cluster`, which builds a Cluster from their names.

Nominal figures for planning; a real deployment overrides them from measurements (a JSON
topology, or `hetjax.planner.calibrate`).
"""

from __future__ import annotations

from hetjax.errors import TopologyError
from hetjax.hardware import Accelerator, Cluster, Link, NicSettings

# Nominal figures for planning; a real deployment overrides them from measurements
# (`hetjax calibrate`). Efficiency = achieved / nominal bandwidth under NCCL collectives:
# InfiniBand, RoCE and Ethernet fitted on Holmes Table 1 (`hetjax.planner.calibrate.
# fit_fabrics`, `python scripts/bench_planner.py calibrate`); NVLink from NCCL's own tuning
# model, which caps an A100's NVLink bus bandwidth at 235 of its 300 GB/s; PCIe unmeasured.
LINKS = {
    "nvlink": Link("nvlink", 2400.0, 2.0, efficiency=0.78),  # A100 NVLink3: 300 GB/s per direction
    "pcie": Link("pcie", 256.0, 5.0),  # PCIe 4.0 x16
    "infiniband": Link("infiniband", 200.0, 5.0, efficiency=0.79),  # HDR 200 Gb/s
    "roce": Link("roce", 200.0, 8.0, efficiency=0.26),  # RoCE v2, 200 Gb/s
    "ethernet": Link("ethernet", 25.0, 50.0),  # 25 GbE via TCP sockets; Table 1's anchor (1.0)
}

# The last figure is the nominal memory bandwidth in GB/s (vendor data sheets: A100 80 GB
# SXM 2,039; H100 SXM 3,350; V100 SXM2 900; MI250X 3,277; Ascend 910B 1,600).
ACCELERATORS = {
    "a100": Accelerator("a100", 312.0, 80.0, memory_bandwidth_gbs=2039.0),
    "a800": Accelerator("a800", 312.0, 80.0, memory_bandwidth_gbs=2039.0),
    "h100": Accelerator("h100", 989.0, 80.0, memory_bandwidth_gbs=3350.0),
    "v100": Accelerator("v100", 125.0, 32.0, memory_bandwidth_gbs=900.0),
    "mi250x": Accelerator("mi250x", 383.0, 128.0, vendor="amd", memory_bandwidth_gbs=3277.0),
    "ascend910b": Accelerator("ascend910b", 320.0, 64.0, vendor="huawei",
                              memory_bandwidth_gbs=1600.0),
    # A simulated CPU device: 2 cores shared by 8 of them; a nominal fp32 peak so MFU on the
    # CPU default reads as a fraction of what these cores can do (about 200 GFLOP/s in all),
    # and an eighth of a desktop's ~20 GB/s of DRAM bandwidth.
    "cpu": Accelerator("cpu", 0.025, 2.0, vendor="cpu", memory_bandwidth_gbs=2.5),
}


def accelerator(name: str) -> Accelerator:
    try:
        return ACCELERATORS[name]
    except KeyError:
        raise TopologyError(f"accelerator {name!r} is unknown; known kinds: "
                            f"{', '.join(sorted(ACCELERATORS))}") from None


IB_SETTINGS = NicSettings(hcas=("mlx5_0:1", "mlx5_1:1", "mlx5_2:1", "mlx5_3:1"),
                          socket_ifname="eth0", gdr_level="PHB")
ROCE_SETTINGS = NicSettings(hcas=("mlx5_bond_0:1", "mlx5_bond_1:1"), gid_index=3,
                            socket_ifname="eth0", gdr_level="PHB")
ETH_SETTINGS = NicSettings(socket_ifname="eth0")


def nic_settings_for(kind: str) -> NicSettings:
    return {"infiniband": IB_SETTINGS, "roce": ROCE_SETTINGS}.get(kind, ETH_SETTINGS)


def make_cluster(name: str, nodes: int, devices_per_node: int, accel: str | Accelerator,
                 nic: str | Link, intra: str | Link = "nvlink",
                 settings: NicSettings | None = None) -> Cluster:
    nic_link = LINKS[nic] if isinstance(nic, str) else nic
    return Cluster(
        name=name, nodes=nodes, devices_per_node=devices_per_node,
        accelerator=accelerator(accel) if isinstance(accel, str) else accel,
        nic=nic_link, intra_node=LINKS[intra] if isinstance(intra, str) else intra,
        nic_settings=settings if settings is not None else nic_settings_for(nic_link.kind))

