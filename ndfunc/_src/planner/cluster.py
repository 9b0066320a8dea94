"""Devices, links and clusters: the hardware numbers the planner prices a layout with.

Every figure is a vendor datasheet number (dense bf16, no 2:4 sparsity) unless it says otherwise.
Bandwidths are stored **per GPU, per direction**, in bytes/s: a ring collective sends to one
neighbour while it receives from the other, so each rank's traffic uses one direction of its link,
and a collective's seconds (`collective_cost`, one model for the partitioner, the closed forms
and the replay) divide the bytes it sends by that figure. NVLink datasheet numbers are total
bidirectional per GPU (H100: 900 GB/s = 450 GB/s each way); InfiniBand is quoted per port and per
direction in bits (NDR 400 Gb/s = 50 GB/s each way, one port per GPU on DGX/HGX nodes).

HBM sizes are the datasheet "GB", which for HBM stacks are binary (an 80 GB H100 shows 81,559 MiB
in nvidia-smi), so they are stored as GiB; what the driver keeps back is in the planner's fixed
framework allowance (`estimate.OVERHEAD_BYTES`).
"""

from __future__ import annotations

import dataclasses

from ndfunc._src.collective_cost import Link

GiB = 2**30
GB = 10**9
TFLOPS = 10**12


@dataclasses.dataclass(frozen=True)
class Device:
    """One accelerator: memory, peak dense matmul rates and HBM bandwidth.

    Args:
        name: a label for tables.
        memory_bytes: HBM capacity.
        peak_bf16_flops: dense bf16 tensor-core peak, flop/s.
        peak_fp8_flops: dense fp8 peak, flop/s; `None` where the device has no fp8 tensor cores
            (A100), so a float8 layout cannot be priced on it.
        memory_bandwidth: HBM bytes/s; prices the memory-bound optimizer step (and, reading a
            program, every op that moves more than it computes).
        peak_fp32_flops: dense fp32 peak without tensor cores (torch multiplies fp32 so unless
            TF32 is allowed), flop/s, for programs that compute in fp32; `None`: the bf16 figure
            (a CPU measured at its own fp32 rate).

    Example:
        >>> Device.cpu(memory_bytes=64 * GiB, peak_flops=2e12, memory_bandwidth=100e9).name
        'cpu'
    """

    name: str
    memory_bytes: float
    peak_bf16_flops: float
    peak_fp8_flops: float | None
    memory_bandwidth: float
    peak_fp32_flops: float | None = None

    def __post_init__(self) -> None:
        for field in ("memory_bytes", "peak_bf16_flops", "memory_bandwidth"):
            if not getattr(self, field) > 0:
                raise ValueError(f"Device.{field} must be > 0, got {getattr(self, field)!r}.")

    @property
    def peak_fp32(self) -> float:
        return self.peak_bf16_flops if self.peak_fp32_flops is None else self.peak_fp32_flops

    @classmethod
    def cpu(cls, *, memory_bytes: float, peak_flops: float, memory_bandwidth: float) -> Device:
        """A CPU "device" whose numbers the caller measured (no vendor figure fits every CPU)."""
        return cls("cpu", memory_bytes, peak_flops, None, memory_bandwidth)


@dataclasses.dataclass(frozen=True)
class Cluster:
    """`num_gpus` devices, `gpus_per_node` to a node; NVLink-class links inside, a fabric between.

    Bandwidths are per GPU and per direction (see the module docstring); latencies per ring hop.

    Example:
        >>> c = Cluster.of("h100", 16)
        >>> c.num_nodes, c.intra.bandwidth / 1e9, c.inter.bandwidth / 1e9
        (2, 450.0, 50.0)
    """

    num_gpus: int
    gpus_per_node: int
    device: Device
    intra_bandwidth: float
    intra_latency: float
    inter_bandwidth: float
    inter_latency: float

    def __post_init__(self) -> None:
        for field in ("num_gpus", "gpus_per_node"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Cluster.{field} must be an int >= 1, got {value!r}.")
        if self.num_gpus > self.gpus_per_node and self.num_gpus % self.gpus_per_node:
            raise ValueError(
                f"Cluster of {self.num_gpus} GPUs with {self.gpus_per_node} per node: more than one node needs "
                f"whole nodes; use a multiple of {self.gpus_per_node} GPUs or set gpus_per_node."
            )

    @property
    def num_nodes(self) -> int:
        return -(-self.num_gpus // self.gpus_per_node)

    @property
    def intra(self) -> Link:
        return Link(self.intra_bandwidth, self.intra_latency)

    @property
    def inter(self) -> Link:
        return Link(self.inter_bandwidth, self.inter_latency)

    def crosses_nodes(self, size: int, stride: int) -> bool:
        """Whether a group of `size` ranks, `stride` apart, spans more than one node.

        Ranks lie row-major on the mesh, so an axis's group is `r, r + stride, ...`; it stays
        inside one node when `size * stride` ranks tile a node evenly. A group spanning nodes runs
        at the fabric's per-GPU rate (`collective_cost.machine`: NCCL drives every GPU's own NIC,
        so the slowest hop sets the ring's pace).
        """
        return size > 1 and self.spans_nodes(size * stride)

    def spans_nodes(self, span: int) -> bool:
        """Whether `span` consecutive ranks (row-major, from a multiple of `span`) lie on more than
        one node: unless they tile a node evenly."""
        return not (span <= self.gpus_per_node and self.gpus_per_node % span == 0)

    @classmethod
    def of(cls, gpu: str | Device, num_gpus: int, gpus_per_node: int = 8) -> Cluster:
        """A cluster of a built-in GPU (`gpu_names()`) or of your own `Device`, with its links."""
        if isinstance(gpu, Device):
            if gpu.name in _LINKS:
                return cls(num_gpus, gpus_per_node, gpu, *_LINKS[gpu.name])
            raise ValueError(f"Cluster.of has no link figures for device {gpu.name!r}; build Cluster(...) with them.")
        key = gpu.lower()
        if key == "cpu":
            raise ValueError(
                "Cluster.of('cpu'): CPUs have no vendor figures; measure them and build "
                "Cluster(num_gpus, gpus_per_node, Device.cpu(...), intra_bandwidth, intra_latency, "
                "inter_bandwidth, inter_latency)."
            )
        if key not in _DEVICES:
            raise ValueError(f"unknown GPU {gpu!r}: expected one of {', '.join(gpu_names())}.")
        return cls(num_gpus, gpus_per_node, _DEVICES[key], *_LINKS[key])


def check_cluster(cluster: object, where: str) -> None:
    """A clear error where `where` was given something other than a `Cluster` (a GPU's name)."""
    if not isinstance(cluster, Cluster):
        raise TypeError(f"{where}: cluster must be a Cluster, got {cluster!r}; build one with Cluster.of(gpu, "
                        f"num_gpus) (gpu one of {', '.join(gpu_names())}) or Cluster(...) with your own figures.")


def gpu_names() -> tuple[str, ...]:
    """The built-in GPUs `Cluster.of` knows."""
    return tuple(_DEVICES)


def device(name: str) -> Device:
    """A built-in GPU by name (`gpu_names()`)."""
    if name.lower() not in _DEVICES:
        raise ValueError(f"unknown GPU {name!r}: expected one of {', '.join(gpu_names())}.")
    return _DEVICES[name.lower()]


# Datasheets: NVIDIA A100 Tensor Core GPU (SXM4 80GB: 312 TFLOPS bf16 dense, 2,039 GB/s, no FP8);
# H100 Tensor Core GPU (SXM5: 989 TFLOPS bf16 and 1,979 TFLOPS FP8 dense, 80 GB, 3.35 TB/s);
# H200 (SXM: same tensor cores as H100, 141 GB HBM3e, 4.8 TB/s); DGX B200 (per GPU: 2.25 PFLOPS
# bf16 and 4.5 PFLOPS FP8 dense, 1,440 GB for 8 GPUs = 180 GB each, 8 TB/s). FP32 without tensor
# cores: A100 19.5, H100 and H200 SXM 67, HGX B200 75 TFLOPS per GPU.
_DEVICES = {
    "a100": Device("A100-SXM-80GB", 80 * GiB, 312 * TFLOPS, None, 2039 * GB, 19.5 * TFLOPS),
    "h100": Device("H100-SXM-80GB", 80 * GiB, 989 * TFLOPS, 1979 * TFLOPS, 3350 * GB, 67 * TFLOPS),
    "h200": Device("H200-SXM-141GB", 141 * GB, 989 * TFLOPS, 1979 * TFLOPS, 4800 * GB, 67 * TFLOPS),
    "b200": Device("B200-180GB", 180 * GB, 2250 * TFLOPS, 4500 * TFLOPS, 8000 * GB, 75 * TFLOPS),
}

# (intra bandwidth, intra latency, inter bandwidth, inter latency), per GPU and per direction.
# NVLink 3/4/5: 600/900/900/1,800 GB/s total bidirectional per GPU -> half each way. One NIC per
# GPU: HDR 200 Gb/s (A100 nodes), NDR 400 Gb/s (H100/H200/B200 nodes) -> /8 bytes each way.
# Latencies are per ring hop and an assumption of this model, the order of NCCL's own tuning
# constants (about a microsecond over NVLink, ten through a NIC and a switch).
_NVLINK_LATENCY, _IB_LATENCY = 1e-6, 10e-6
_LINKS = {
    "a100": (300 * GB, _NVLINK_LATENCY, 25 * GB, _IB_LATENCY),
    "h100": (450 * GB, _NVLINK_LATENCY, 50 * GB, _IB_LATENCY),
    "h200": (450 * GB, _NVLINK_LATENCY, 50 * GB, _IB_LATENCY),
    "b200": (900 * GB, _NVLINK_LATENCY, 50 * GB, _IB_LATENCY),
}
_LINKS.update({d.name: _LINKS[k] for k, d in _DEVICES.items()})
