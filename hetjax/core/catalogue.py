"""The catalogue of nominal hardware: link classes, accelerator kinds, NIC settings, and
`make_cluster`, which builds a Cluster from their names.

Nominal figures for planning; a real deployment overrides them from measurements (a JSON
topology, or `hetjax.planner.calibrate`).
"""

from __future__ import annotations

from hetjax.errors import TopologyError
from hetjax.core.hardware import Accelerator, Cluster, Link, NicSettings

# Links, each under its catalogue name: what a topology file's "nic", "intra_node",
# "inter_cluster" and cluster links may name (docs/topology.md lists them). Rates are per
# direction, per GPU for NVLink and PCIe, per node for a NIC, in Gbit/s; vendors quote NVLink
# bidirectionally (A100: 600 GB/s = 300 GB/s each way = 2,400 Gbit/s).
# Efficiency = achieved / nominal bandwidth under NCCL collectives: InfiniBand, RoCE and
# Ethernet fitted on Holmes Table 1 at 200 / 200 / 25 Gb/s (`hetjax.planner.calibrate.
# fit_fabrics`, `python scripts/bench/planner.py calibrate`) and assumed the same at a fabric's
# other rates; NVLink from NCCL's own tuning model, which caps an A100's NVLink bus bandwidth at
# 235 of its 300 GB/s, assumed for every NVLink generation and bridge; PCIe unmeasured (1.0).
# Latencies are nominal per fabric. Without peer-to-peer (p2p=False) a PCIe link's traffic is
# staged through host memory; hetjax.core.hardware.Link prices that (half the bandwidth, twice
# the latency).
_NVLINK = dict(latency_us=2.0, efficiency=0.78)
LINKS = {
    # NVLink between the GPUs of one node, all-to-all through NVSwitch (or direct links).
    # NVIDIA Tesla V100 data sheet: NVLink 300 GB/s (SXM2; 6 NVLink 2 links of 25 GB/s each way).
    "nvlink2": Link("nvlink", 1200.0, **_NVLINK),
    # NVIDIA A100 data sheet: NVLink 600 GB/s (12 NVLink 3 links).
    "nvlink3": Link("nvlink", 2400.0, **_NVLINK),
    # NVIDIA H100 data sheet: NVLink 900 GB/s (SXM; 18 NVLink 4 links); H200 the same.
    "nvlink4": Link("nvlink", 3600.0, **_NVLINK),
    # NVIDIA A800 and H800 data sheets: NVLink 400 GB/s (export versions of A100 / H100 SXM).
    "nvlink_a800_h800": Link("nvlink", 1600.0, **_NVLINK),
    # Two-card NVLink bridges (a node of 2 GPUs; larger nodes talk over PCIe, see the docs):
    # NVIDIA TITAN RTX and GeForce RTX 2080 Ti pages: NVLink (2 links) 100 GB/s bidirectional.
    "nvlink2_bridge": Link("nvlink", 400.0, **_NVLINK),
    # NVIDIA GeForce RTX 3090 and A40 data sheets: NVLink (4 links) 112.5 GB/s bidirectional.
    "nvlink3_bridge": Link("nvlink", 450.0, **_NVLINK),
    # PCIe x16 slots (PCI-SIG): 8 / 16 / 32 GT/s per lane for gen 3 / 4 / 5, the raw rate per
    # direction; `_no_p2p`: the same slot when the GPUs cannot reach each other's memory.
    "pcie3": Link("pcie", 128.0, 5.0),
    "pcie4": Link("pcie", 256.0, 5.0),
    "pcie5": Link("pcie", 512.0, 5.0),
    "pcie3_no_p2p": Link("pcie", 128.0, 5.0, p2p=False),
    "pcie4_no_p2p": Link("pcie", 256.0, 5.0, p2p=False),
    "pcie5_no_p2p": Link("pcie", 512.0, 5.0, p2p=False),
    # NICs between the nodes of a cluster, per node. InfiniBand EDR / HDR / NDR (NVIDIA
    # ConnectX-5 / -6 / -7 data sheets: 100 / 200 / 400 Gb/s).
    "ib_edr_100g": Link("infiniband", 100.0, 5.0, efficiency=0.79),
    "ib_hdr_200g": Link("infiniband", 200.0, 5.0, efficiency=0.79),
    "ib_ndr_400g": Link("infiniband", 400.0, 5.0, efficiency=0.79),
    # RoCE v2 on Ethernet NICs of 100 / 200 / 400 Gb/s.
    "roce_100g": Link("roce", 100.0, 8.0, efficiency=0.26),
    "roce_200g": Link("roce", 200.0, 8.0, efficiency=0.26),
    "roce_400g": Link("roce", 400.0, 8.0, efficiency=0.26),
    # Ethernet through NCCL's TCP sockets; 25 GbE is Table 1's anchor (efficiency 1.0).
    "eth_1g": Link("ethernet", 1.0, 50.0),
    "eth_10g": Link("ethernet", 10.0, 50.0),
    "eth_25g": Link("ethernet", 25.0, 50.0),
    "eth_100g": Link("ethernet", 100.0, 50.0),
}
# The first names, kept: a name without its generation or rate means these. A topology file
# may use them; written topologies use the names above.
LINK_ALIASES = {"nvlink": "nvlink3", "pcie": "pcie4", "infiniband": "ib_hdr_200g",
                "roce": "roce_200g", "ethernet": "eth_25g"}
LINKS.update({alias: LINKS[name] for alias, name in LINK_ALIASES.items()})


def link_name(link: Link) -> str | None:
    """The catalogue name of a link equal to `link` (never an alias), or None."""
    return next((name for name, lk in LINKS.items()
                 if lk == link and name not in LINK_ALIASES), None)


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
    # --- the kinds people own (docs/topology.md lists them). Dense tensor-core peaks without
    # sparsity, at bf16 with fp32 accumulation (what training runs); Volta and Turing (V100, T4,
    # RTX 2080 Ti, TITAN RTX) have no bf16 tensor cores: their fp16 peak. GDDR data-centre
    # cards reserve some memory for ECC (a T4 shows 15 GiB): the figure is the vendor's.
    # NVIDIA Tesla V100 data sheet: SXM2 125 TFLOP/s fp16 tensor, 16 or 32 GB HBM2, 900 GB/s.
    "v100_16gb": Accelerator("v100_16gb", 125.0, 16.0, memory_bandwidth_gbs=900.0),
    "v100_32gb": Accelerator("v100_32gb", 125.0, 32.0, memory_bandwidth_gbs=900.0),
    # NVIDIA T4 data sheet: 65 TFLOP/s mixed precision (fp16/fp32), 16 GB GDDR6, 320 GB/s.
    "t4": Accelerator("t4", 65.0, 16.0, memory_bandwidth_gbs=320.0),
    # NVIDIA Turing GPU architecture whitepaper, appendix table 1: GeForce RTX 2080 Ti
    # (reference clocks) 53.8 TFLOP/s fp16 tensor with fp32 accumulate (107.6 with fp16
    # accumulate), 11 GB GDDR6, 616 GB/s.
    "rtx_2080_ti": Accelerator("rtx_2080_ti", 53.8, 11.0, memory_bandwidth_gbs=616.0),
    # NVIDIA TITAN RTX product page: 130 tensor TFLOP/s (fp16, full-rate fp32 accumulate),
    # 24 GB GDDR6, 672 GB/s.
    "titan_rtx": Accelerator("titan_rtx", 130.0, 24.0, memory_bandwidth_gbs=672.0),
    # NVIDIA Ampere GA102 GPU architecture whitepaper, appendix table 9: GeForce RTX 3090
    # 71 TFLOP/s bf16 tensor with fp32 accumulate (142 fp16 with fp16 accumulate), 24 GB GDDR6X,
    # 936 GB/s.
    "rtx_3090": Accelerator("rtx_3090", 71.0, 24.0, memory_bandwidth_gbs=936.0),
    # NVIDIA Ada GPU architecture whitepaper, appendix table 2: GeForce RTX 4090 165.2 TFLOP/s
    # bf16 tensor with fp32 accumulate (330.3 fp16 with fp16 accumulate), 24 GB GDDR6X, 1,008 GB/s.
    "rtx_4090": Accelerator("rtx_4090", 165.2, 24.0, memory_bandwidth_gbs=1008.0),
    # NVIDIA A10 data sheet: 125 TFLOP/s bf16 tensor (250 with sparsity), 24 GB GDDR6, 600 GB/s.
    "a10": Accelerator("a10", 125.0, 24.0, memory_bandwidth_gbs=600.0),
    # NVIDIA A40 data sheet: 149.7 TFLOP/s bf16 tensor (299.4 with sparsity), 48 GB GDDR6,
    # 696 GB/s.
    "a40": Accelerator("a40", 149.7, 48.0, memory_bandwidth_gbs=696.0),
    # NVIDIA L4 data sheet: 242 TFLOP/s bf16 tensor with sparsity, so 121 dense; 24 GB GDDR6,
    # 300 GB/s.
    "l4": Accelerator("l4", 121.0, 24.0, memory_bandwidth_gbs=300.0),
    # NVIDIA H800 data sheet (SXM): 989 TFLOP/s bf16 dense (1,979 with sparsity), 80 GB HBM3,
    # 3.35 TB/s; NVLink 400 GB/s (`nvlink_a800_h800`). The A800 above: NVIDIA A800 data sheet
    # (SXM), the A100's 312 TFLOP/s and 80 GB HBM2e at 2,039 GB/s, NVLink 400 GB/s.
    "h800": Accelerator("h800", 989.0, 80.0, memory_bandwidth_gbs=3350.0),
    # AMD Instinct MI250X data sheet: 383 TFLOP/s bf16, 128 GB HBM2e, 3.2768 TB/s per package of
    # two graphics compute dies (GCDs). JAX sees each GCD as a device: 191.5 TFLOP/s, 64 GB,
    # 1.6384 TB/s. `mi250x` (the package) is kept as it was; a node of 4 MI250X is 8 devices
    # of `mi250x_gcd`.
    "mi250x_gcd": Accelerator("mi250x_gcd", 191.5, 64.0, vendor="amd",
                              memory_bandwidth_gbs=1638.4),
    "ascend910b": Accelerator("ascend910b", 320.0, 64.0, vendor="huawei",
                              memory_bandwidth_gbs=1600.0),
    # A simulated CPU device: 2 cores shared by 8 of them; a nominal fp32 peak so MFU on the
    # CPU default reads as a fraction of what these cores can do (about 200 GFLOP/s in all),
    # and an eighth of a desktop's ~20 GB/s of DRAM bandwidth.
    "cpu": Accelerator("cpu", 0.025, 2.0, vendor="cpu", memory_bandwidth_gbs=2.5),
}


# JAX's `device.device_kind` -> catalogue name, first match wins (lower-cased, searched).
# Kinds as the runtimes report them: "NVIDIA H100 80GB HBM3" (SXM), "NVIDIA H100 PCIe",
# "NVIDIA A100-SXM4-40GB", "NVIDIA A100 80GB PCIe", "Tesla V100-SXM2-16GB", "Tesla T4",
# "NVIDIA GeForce RTX 4090", "NVIDIA L4", "NVIDIA A10", "AMD Instinct MI300X", "TPU v4",
# "TPU v5 lite" (v5e), "TPU v5p" / "TPU v5", "TPU v6 lite" (v6e), "cpu".
DEVICE_KINDS: tuple[tuple[str, str], ...] = (
    (r"h200", "h200"),
    (r"h100.*pcie", "h100_pcie"),
    (r"h100", "h100_sxm"),
    (r"a100.*40\s*gb", "a100_40gb"),
    (r"a100", "a100_80gb"),
    (r"a800", "a800"),
    (r"h800", "h800"),
    (r"l40s", "l40s"),
    (r"\bl4\b", "l4"),
    (r"\ba10\b", "a10"),
    (r"\ba40\b", "a40"),
    (r"v100.*16\s*gb", "v100_16gb"),
    (r"v100", "v100"),
    (r"\bt4\b", "t4"),
    (r"rtx\s*2080\s*ti", "rtx_2080_ti"),
    (r"titan\s*rtx", "titan_rtx"),
    (r"rtx\s*3090", "rtx_3090"),
    (r"rtx\s*4090", "rtx_4090"),
    (r"mi300x", "mi300x"),
    (r"mi250", "mi250x_gcd"),  # JAX's device is one of the package's two dies
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


def link(name: str) -> Link:
    """The catalogue's link of that name (an alias included)."""
    try:
        return LINKS[name]
    except KeyError:
        raise TopologyError(f"link {name!r} is unknown; known links: "
                            f"{', '.join(n for n in LINKS if n not in LINK_ALIASES)}") from None


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
    """A Cluster of catalogue names (or objects); NIC settings default to the catalogue's for
    the NIC's kind."""
    nic_link = link(nic) if isinstance(nic, str) else nic
    return Cluster(
        name=name, nodes=nodes, devices_per_node=devices_per_node,
        accelerator=accelerator(accel) if isinstance(accel, str) else accel,
        nic=nic_link, intra_node=link(intra) if isinstance(intra, str) else intra,
        nic_settings=settings if settings is not None else nic_settings_for(nic_link.kind))

