"""The catalogue of nominal hardware: link classes, accelerator kinds, NIC settings, and
`make_cluster`, which builds a Cluster from their names.

Nominal figures for planning; a real deployment overrides them from measurements (a JSON
topology, or `hetjax.planner.calibrate`).
"""

from __future__ import annotations

from hetjax.errors import TopologyError
from hetjax.core.hardware import Accelerator, Cluster, Link, NicSettings

# Nominal figures for planning; a real deployment overrides them from measurements
# (`hetjax calibrate`). Efficiency = achieved / nominal bandwidth under NCCL collectives:
# InfiniBand, RoCE and Ethernet fitted on Holmes Table 1 (`hetjax.planner.calibrate.
# fit_fabrics`, `python scripts/bench/planner.py calibrate`); NVLink from NCCL's own tuning
# model, which caps an A100's NVLink bus bandwidth at 235 of its 300 GB/s; PCIe unmeasured.
LINKS = {
    "nvlink": Link("nvlink", 2400.0, 2.0, efficiency=0.78),  # A100 NVLink3: 300 GB/s per direction
    "pcie": Link("pcie", 256.0, 5.0),  # PCIe 4.0 x16
    "infiniband": Link("infiniband", 200.0, 5.0, efficiency=0.79),  # HDR 200 Gb/s
    "roce": Link("roce", 200.0, 8.0, efficiency=0.26),  # RoCE v2, 200 Gb/s
    "ethernet": Link("ethernet", 25.0, 50.0),  # 25 GbE via TCP sockets; Table 1's anchor (1.0)
}

# Peak dense (no sparsity) bf16 TFLOP/s and memory from the vendors' data sheets; memory is the
# vendor's "GB" figure, which for HBM parts is what the runtime reports in GiB (an 80 GB H100
# shows 79.6 GiB). The `local` preset reads the runtime's own capacity when it reports one.
# memory_bandwidth_gbs: nominal HBM / GDDR bandwidth in GB/s from the same data sheets (A100
# 40 GB 1,555, 80 GB 2,039; H100 SXM 3,350, PCIe 2,000; H200 4,800; L40S 864; MI300X 5,300;
# TPU v4 1,200, v5e 819, v5p 2,765, v6e 1,640; V100 900; MI250X 3,277; Ascend 910B 1,600).
ACCELERATORS = {
    # NVIDIA A100 data sheet: 312 TFLOP/s BF16 Tensor Core (dense), 40 GB or 80 GB HBM2/HBM2e.
    "a100": Accelerator("a100", 312.0, 80.0, memory_bandwidth_gbs=2039.0),
    "a100_40gb": Accelerator("a100_40gb", 312.0, 40.0, memory_bandwidth_gbs=1555.0),
    "a100_80gb": Accelerator("a100_80gb", 312.0, 80.0, memory_bandwidth_gbs=2039.0),
    "a800": Accelerator("a800", 312.0, 80.0, memory_bandwidth_gbs=2039.0),
    # NVIDIA H100 data sheet: SXM 989 TFLOP/s BF16 dense (1,979 with sparsity), 80 GB HBM3;
    # PCIe 756 TFLOP/s dense (1,513 with sparsity), 80 GB HBM2e.
    "h100": Accelerator("h100", 989.0, 80.0, memory_bandwidth_gbs=3350.0),
    "h100_sxm": Accelerator("h100_sxm", 989.0, 80.0, memory_bandwidth_gbs=3350.0),
    "h100_pcie": Accelerator("h100_pcie", 756.0, 80.0, memory_bandwidth_gbs=2000.0),
    # NVIDIA H200 data sheet: 989 TFLOP/s BF16 dense (1,979 with sparsity), 141 GB HBM3e.
    "h200": Accelerator("h200", 989.0, 141.0, memory_bandwidth_gbs=4800.0),
    # NVIDIA L40S data sheet: 362.05 TFLOP/s BF16 dense (733 with sparsity), 48 GB GDDR6.
    "l40s": Accelerator("l40s", 362.0, 48.0, memory_bandwidth_gbs=864.0),
    # AMD Instinct MI300X data sheet: 1,307.4 TFLOP/s BF16 dense, 192 GB HBM3.
    "mi300x": Accelerator("mi300x", 1307.4, 192.0, vendor="amd", memory_bandwidth_gbs=5300.0),
    # Google Cloud TPU system architecture pages, per chip: v4 275 TFLOP/s BF16, 32 GiB HBM;
    # v5e 197 TFLOP/s, 16 GiB; v5p 459 TFLOP/s, 95 GiB; v6e (Trillium) 918 TFLOP/s, 32 GiB.
    "tpu_v4": Accelerator("tpu_v4", 275.0, 32.0, vendor="google", memory_bandwidth_gbs=1200.0),
    "tpu_v5e": Accelerator("tpu_v5e", 197.0, 16.0, vendor="google", memory_bandwidth_gbs=819.0),
    "tpu_v5p": Accelerator("tpu_v5p", 459.0, 95.0, vendor="google", memory_bandwidth_gbs=2765.0),
    "tpu_v6e": Accelerator("tpu_v6e", 918.0, 32.0, vendor="google", memory_bandwidth_gbs=1640.0),
    "v100": Accelerator("v100", 125.0, 32.0, memory_bandwidth_gbs=900.0),
    "mi250x": Accelerator("mi250x", 383.0, 128.0, vendor="amd", memory_bandwidth_gbs=3277.0),
    "ascend910b": Accelerator("ascend910b", 320.0, 64.0, vendor="huawei",
                              memory_bandwidth_gbs=1600.0),
    # A simulated CPU device: 2 cores shared by 8 of them; a nominal fp32 peak so MFU on the
    # CPU default reads as a fraction of what these cores can do (about 200 GFLOP/s in all),
    # and an eighth of a desktop's ~20 GB/s of DRAM bandwidth.
    "cpu": Accelerator("cpu", 0.025, 2.0, vendor="cpu", memory_bandwidth_gbs=2.5),
}


# JAX's `device.device_kind` -> catalogue name, first match wins (lower-cased, searched).
# Kinds as the runtimes report them: "NVIDIA H100 80GB HBM3" (SXM), "NVIDIA H100 PCIe",
# "NVIDIA A100-SXM4-40GB", "NVIDIA A100 80GB PCIe", "AMD Instinct MI300X", "TPU v4",
# "TPU v5 lite" (v5e), "TPU v5p" / "TPU v5", "TPU v6 lite" (v6e), "cpu".
DEVICE_KINDS: tuple[tuple[str, str], ...] = (
    (r"h200", "h200"),
    (r"h100.*pcie", "h100_pcie"),
    (r"h100", "h100_sxm"),
    (r"a100.*40\s*gb", "a100_40gb"),
    (r"a100", "a100_80gb"),
    (r"a800", "a800"),
    (r"l40s", "l40s"),
    (r"v100", "v100"),
    (r"mi300x", "mi300x"),
    (r"mi250", "mi250x"),
    (r"tpu\s*v4", "tpu_v4"),
    (r"tpu\s*v5\s*(lite|e)", "tpu_v5e"),
    (r"tpu\s*v5", "tpu_v5p"),
    (r"tpu\s*v6", "tpu_v6e"),
    (r"^cpu$", "cpu"),
)


def accelerator_for_kind(device_kind: str) -> str | None:
    """The catalogue name of a JAX `device_kind`, or None when the catalogue has no entry."""
    import re

    kind = device_kind.strip().lower()
    return next((name for pattern, name in DEVICE_KINDS if re.search(pattern, kind)), None)


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

