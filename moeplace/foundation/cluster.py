"""Cluster topology: nodes x GPUs per node, the GPU kind, the NVLink domain inside a node and the NIC
between nodes. GPU numbers are data (``foundation/presets/gpus.json``, from docs/design.md Sources §2).

GPU ``g`` lives on node ``g // gpus_per_node``. A "node" is an NVLink domain (8 GPUs on HGX, 72 on
GB300 NVL72): what the cost model and the all-to-all backend choice use. A *host* is one machine, which
runs one engine process in a multi-node launch: ``gpus_per_host`` GPUs (the whole node on HGX; 4 on an
NVL72 rack, whose 72 GPUs sit in 18 compute trays). The launch commands and files count hosts.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from functools import cached_property
from importlib import resources
from pathlib import Path

import networkx as nx

from moeplace.foundation import limits
from moeplace.foundation.errors import InputError
from moeplace.foundation.reading import quote

FP4_FORMATS = ("mxfp4", "nvfp4", "fp4")  # 4-bit floats with block scales: FP4 tensor cores on Blackwell
WEIGHT_ONLY_FORMATS = ("int4_g32",)  # INT4 weights, BF16 activations (Marlin-style W4A16 kernels)


@dataclass(frozen=True)
class GPUSpec:
    """One GPU kind. Bandwidths in bytes/s per direction per GPU, latencies in seconds, FLOP/s dense."""

    name: str
    hbm_bytes: float
    hbm_bw: float
    flops_bf16: float
    flops_fp8: float
    flops_fp4: float  # 0 when the GPU has no FP4 tensor cores (Hopper): FP4 weights run at FP8 rate
    nvlink_bw: float
    nvlink_latency: float
    nic_bw: float
    nic_latency: float
    gpus_per_node: int = 8  # the NVLink domain
    note: str = ""
    gpus_per_host: int | None = None  # GPUs of one machine (one engine process); None: gpus_per_node
    # the memory CUDA reports to the engines (torch.cuda.mem_get_info's total), which vLLM's
    # gpu_memory_utilization and SGLang's mem_fraction_static are fractions of; None: not established,
    # the marketing ``hbm_bytes`` stands in
    device_memory_bytes: float | None = None

    def __post_init__(self) -> None:
        for f in ("hbm_bytes", "hbm_bw", "flops_bf16", "flops_fp8", "nvlink_bw", "nic_bw"):
            if not getattr(self, f) > 0:
                raise InputError(f"GPU '{self.name}': {f} must be positive")
        if self.device_memory_bytes is not None and not (math.isfinite(self.device_memory_bytes)
                                                          and self.device_memory_bytes > 0):
            raise InputError(f"GPU '{self.name}': device_memory_bytes must be a finite number > 0")
        if self.gpus_per_node < 1:
            raise InputError(f"GPU '{self.name}': gpus_per_node must be >= 1")
        if self.gpus_per_host is None:
            object.__setattr__(self, "gpus_per_host", self.gpus_per_node)
        elif self.gpus_per_host < 1 or self.gpus_per_node % self.gpus_per_host:
            raise InputError(f"GPU '{self.name}': gpus_per_host must be >= 1 and divide gpus_per_node "
                             f"({self.gpus_per_node}), got {self.gpus_per_host}")

    @property
    def memory_bytes(self) -> float:
        """Bytes an engine sizes its memory budget from: the device-reported total where it is known
        (vLLM: ``gpu_memory_utilization`` x ``torch.cuda.mem_get_info()``'s total; SGLang:
        ``mem_fraction_static`` x the free memory after start-up, the same total less the CUDA context),
        else the marketing capacity ``hbm_bytes``."""
        return self.device_memory_bytes if self.device_memory_bytes is not None else self.hbm_bytes

    def flops(self, dtype: str) -> float:
        """Dense tensor-core FLOP/s for GEMMs whose inputs are ``dtype`` (weights' compute format): FP4
        formats on FP4 tensor cores where the GPU has them (else FP8, W4A8); weight-only formats
        (:data:`WEIGHT_ONLY_FORMATS`, W4A16) dequantize to BF16 and run at the BF16 rate."""
        if dtype in WEIGHT_ONLY_FORMATS:
            return self.flops_bf16
        if dtype in FP4_FORMATS:
            return self.flops_fp4 or self.flops_fp8
        if dtype.startswith("fp8"):
            return self.flops_fp8
        return self.flops_bf16


def gpu_preset_names() -> list[str]:
    return sorted(_gpu_presets())


def _gpu_presets() -> dict[str, dict]:
    return json.loads(resources.files("moeplace.foundation.presets").joinpath("gpus.json").read_text())


GPU_FIELDS = ("hbm_bytes", "hbm_bw", "flops_bf16", "flops_fp8", "flops_fp4", "nvlink_bw", "nvlink_latency",
              "nic_bw", "nic_latency", "gpus_per_node", "gpus_per_host", "device_memory_bytes", "note")
_WHOLE = ("gpus_per_node", "gpus_per_host")  # GPU counts: integers >= 1
_OPTIONAL = ("gpus_per_node", "gpus_per_host", "note", "flops_fp4", "device_memory_bytes")


def load_gpu(name: str) -> GPUSpec:
    """A preset name, or a JSON file with the preset fields (``--gpu spec.json``): bandwidths in bytes/s
    per direction per GPU, latencies in seconds, dense FLOP/s; ``name``, ``note``, ``flops_fp4``,
    ``gpus_per_node`` (the NVLink domain, default 8), ``gpus_per_host`` (GPUs per machine, default
    ``gpus_per_node``) and ``device_memory_bytes`` (the total CUDA reports, which the engines' memory
    fractions apply to; default: ``hbm_bytes``) optional."""
    presets = _gpu_presets()
    if name in presets:
        return GPUSpec(name=name, **presets[name])
    if name.endswith(".json") or Path(name).is_file():
        from moeplace.foundation.files import read_json
        d = read_json(name, "no such GPU spec file", "not a readable JSON GPU spec")
        if not isinstance(d, dict):
            raise InputError(f"{name}: expected a JSON object with fields {', '.join(GPU_FIELDS)}")
        if "device_memory_bytes" in d and d["device_memory_bytes"] is None:  # null: not established
            d = {k: v for k, v in d.items() if k != "device_memory_bytes"}
        unknown = sorted(set(d) - set(GPU_FIELDS) - {"name"})
        if unknown:
            raise InputError(f"{name}: unknown field(s) {unknown} (expected {', '.join(GPU_FIELDS)})")
        missing = [f for f in GPU_FIELDS if f not in d and f not in _OPTIONAL]
        if missing:
            raise InputError(f"{name}: missing field(s) {missing}")
        for f in _WHOLE:
            if f in d and (not isinstance(d[f], int) or isinstance(d[f], bool) or d[f] < 1):
                raise InputError(f"{name}: field '{f}' must be an integer >= 1, got {quote(d[f])}")
        per_node = d.get("gpus_per_node", 8)
        if "gpus_per_host" in d and per_node % d["gpus_per_host"]:
            raise InputError(f"{name}: field 'gpus_per_host' ({d['gpus_per_host']}) must divide gpus_per_node "
                             f"({per_node}): a host holds a whole part of the NVLink domain")
        for f in GPU_FIELDS[:-1]:
            if f in _WHOLE:
                continue
            if f in d and not (isinstance(d[f], (int, float)) and not isinstance(d[f], bool)):
                raise InputError(f"{name}: field '{f}' must be a number, got {quote(d[f])}")
            # Infinity / NaN (Python's JSON reads both) would turn into NaN sizes and times downstream
            if f in d and not (math.isfinite(d[f]) and (d[f] >= 0 if f.endswith("latency") or f == "flops_fp4"
                                                        else d[f] > 0)):
                want = ">= 0" if f.endswith("latency") or f == "flops_fp4" else "> 0"
                raise InputError(f"{name}: field '{f}' must be a finite number {want}, got {d[f]!r}")
        kw = {f: d[f] for f in GPU_FIELDS if f in d}
        kw.setdefault("flops_fp4", 0.0)
        return GPUSpec(name=str(d.get("name") or Path(name).stem), **kw)
    raise InputError(f"GPU '{name}' unknown (expected one of {', '.join(sorted(presets))}, or a .json spec file)")


@dataclass(frozen=True)
class ClusterSpec:
    """``num_nodes`` nodes of ``gpus_per_node`` GPUs of kind ``gpu``."""

    gpu: GPUSpec
    num_nodes: int
    gpus_per_node: int

    def __post_init__(self) -> None:
        if self.num_nodes < 1 or self.gpus_per_node < 1:
            raise InputError(f"cluster needs >= 1 node and >= 1 GPU per node, got {self.num_nodes} x "
                             f"{self.gpus_per_node}")
        limits.check_gpus(self.num_nodes * self.gpus_per_node, "cluster GPUs")

    @property
    def num_gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node

    @property
    def name(self) -> str:
        return f"{self.num_nodes}x{self.gpus_per_node} {self.gpu.name}"

    @property
    def gpus_per_host(self) -> int:
        """GPUs per machine (one engine process of a launch): :func:`host_size` of the GPU spec for
        this cluster's node size."""
        return host_size(self.gpu, self.gpus_per_node)

    def node_of(self, gpu: int) -> int:
        return gpu // self.gpus_per_node

    def link(self, a: int, b: int) -> str:
        """``"local"`` (same GPU), ``"nvlink"`` (same node) or ``"nic"`` (across nodes)."""
        if a == b:
            return "local"
        return "nvlink" if self.node_of(a) == self.node_of(b) else "nic"

    def bandwidth(self, a: int, b: int) -> float:
        """Bytes/s one GPU can push to another (per direction); the bottleneck link of the path."""
        return {"local": self.gpu.hbm_bw, "nvlink": self.gpu.nvlink_bw, "nic": self.gpu.nic_bw}[self.link(a, b)]

    def latency(self, a: int, b: int) -> float:
        return {"local": 0.0, "nvlink": self.gpu.nvlink_latency,
                "nic": self.gpu.nic_latency + self.gpu.nvlink_latency}[self.link(a, b)]

    @cached_property
    def graph(self) -> nx.Graph:
        """GPUs ``("gpu", g)`` hang off their node's NVSwitch ``("nvswitch", n)`` with NVLink edges and
        off the scale-out fabric ``("fabric", 0)`` with their NIC edge. Edge attributes: ``bandwidth``
        (bytes/s per direction), ``latency`` (s), ``kind``."""
        g = nx.Graph()
        fabric = ("fabric", 0)
        g.add_node(fabric, kind="fabric")
        for n in range(self.num_nodes):
            g.add_node(("nvswitch", n), kind="nvswitch")
        for i in range(self.num_gpus):
            node = ("gpu", i)
            g.add_node(node, kind="gpu", node=self.node_of(i))
            g.add_edge(node, ("nvswitch", self.node_of(i)), bandwidth=self.gpu.nvlink_bw,
                       latency=self.gpu.nvlink_latency / 2, kind="nvlink")
            if self.num_nodes > 1:
                g.add_edge(node, fabric, bandwidth=self.gpu.nic_bw, latency=self.gpu.nic_latency / 2, kind="nic")
        return g

    def path(self, a: int, b: int) -> list:
        """Lowest-latency path between two GPUs in :attr:`graph`. Inside a node it goes through the
        NVSwitch; across nodes through the sending GPU's NIC and the fabric (NCCL's all-to-all does not
        aggregate several NICs, so one GPU's NIC is the bottleneck)."""
        if a == b:
            return [("gpu", a)]
        if self.node_of(a) == self.node_of(b):
            return [("gpu", a), ("nvswitch", self.node_of(a)), ("gpu", b)]
        return nx.shortest_path(self.graph, ("gpu", a), ("gpu", b), weight="latency")

    def to_dict(self) -> dict:
        """Name, nodes, GPUs per node, and ``gpus_per_host`` where a node spans several hosts (NVL72)."""
        d = {"gpu": self.gpu.name, "num_nodes": self.num_nodes, "gpus_per_node": self.gpus_per_node}
        if self.gpus_per_host != self.gpus_per_node:
            d["gpus_per_host"] = self.gpus_per_host
        return d


def host_size(spec: GPUSpec, per_node: int) -> int:
    """GPUs per host when ``spec``'s node is resized to ``per_node`` GPUs (``--gpus-per-node``): a spec whose
    host is its whole node (HGX) keeps one host per node; a rack of smaller hosts (NVL72: 4) keeps its host
    size, or the largest one dividing a node smaller than that."""
    if spec.gpus_per_host == spec.gpus_per_node:
        return per_node
    return math.gcd(spec.gpus_per_host, per_node)


def make_cluster(gpus: int = 32, gpu: str = "h200", gpus_per_node: int | None = None) -> ClusterSpec:
    """``--gpus 32`` -> 4 nodes of 8 H200. ``gpus`` must be a multiple of ``gpus_per_node`` (or smaller
    than one node)."""
    spec = load_gpu(gpu)
    if gpus_per_node is not None and gpus_per_node < 1:  # 0 is not "the preset's": say so
        raise InputError(f"--gpus-per-node must be >= 1, got {gpus_per_node}")
    per_node = spec.gpus_per_node if gpus_per_node is None else gpus_per_node
    if gpus < 1:
        raise InputError(f"--gpus must be >= 1, got {gpus}")
    limits.check_gpus(gpus)
    if gpus < per_node and gpus_per_node is None:
        per_node = gpus
    if gpus % per_node:
        raise InputError(f"--gpus {gpus} is not a multiple of --gpus-per-node {per_node}")
    return ClusterSpec(gpu=replace(spec, gpus_per_node=per_node, gpus_per_host=host_size(spec, per_node)),
                       num_nodes=gpus // per_node, gpus_per_node=per_node)
