"""Measured kernel costs: NVIDIA aiconfigurator's silicon tables behind the simulator's cost model.

``aiconfigurator-core`` (Apache-2.0, PyPI; a moeplace dependency) ships per-operation latencies measured on
H100/H200/B200/B300/GB200/GB300 for TensorRT-LLM, SGLang and vLLM releases, and answers a query for one
operation through its public op-list API (``EngineHandle.for_database(get_database(system, backend,
version)).evaluate_ops_json(build_ops_json([op]), ...)``: latency in ms and the source that priced it,
``silicon`` for a table value, interpolated between the collected shapes by its own engine).
:class:`MeasuredCostModel` answers the questions :class:`sim.cost.CostModel` answers from those tables, by
GPU and engine release, and keeps the roofline for everything no table covers; :attr:`MeasuredCostModel.terms`
says which source priced each term (``place simulate --json``: ``summary.cost_model``).

What each table prices (queried once per cost model on a grid, then interpolated log-log per call):

- ``experts`` (the trace-driven part stays moeplace's): the MoE op's table on the model's expert shape and
  dtype, balanced routing, at the pool's EP size (else the nearest EP size the table holds), with the run's
  MoE TP. The table's GPU serves ``E / ep`` local experts at ``x k / ep`` selections (or ``x k``: the
  collectors differ; the faster reading that keeps the GPU under its peak FLOP rate is used, and named);
  with every local expert touched, ``T(x) / (E / ep)`` is one touched expert's time at that many rows per
  expert. Each GPU of the simulation is then charged ``touched x t(tokens / touched)``: its own token count
  and its own distinct-expert count from the routing, not the table's fixed token distribution.
- ``projections:<kind>``, ``trunk:moe`` / ``trunk:dense``, ``lm_head``: the GEMM table at the layer's real
  shapes (MLA: fused q_a/kv_a down-projection, q_b, kv_b, o; the dense MLP and shared experts as gate+up and
  down; the router; LatentMoE's down/up projections), TP-split as the roofline splits them; KDA and GQA
  projections as one GEMM of the block's parameters (K = hidden size).
- ``mla_decode`` / ``mla_prefill``: the generation / context MLA tables at the rank's batch and mean context
  (decode: decoding sequences at mean keys per query token; prefill: per chunk at its mean length and
  prefix, times the chunks).
- ``kda_decode`` / ``kda_prefill``: the KDA table (SGLang, vLLM) with the kernels aiconfigurator's Kimi K3
  model runs per engine: conv update + recurrence per decoding sequence count; conv + chunked scan per chunk.
- ``allreduce``: the custom all-reduce table over the attention TP group (tokens x hidden, BF16).
- ``allgather``: NCCL all-gather + reduce-scatter tables over the EP group (TensorRT-LLM's MoE under
  attention DP), at the bytes :meth:`sim.cost.CostModel.allgather_bytes` / ``copy_bytes("combine")`` move.

Roofline (labelled so) everywhere else: DeepEP all-to-all (the tables hold no per-GPU-load all-to-all),
the GQA attention core, collectives across nodes, weight/KV transfers, and any op the tables do not
hold for this GPU, engine, shape or dtype (the MoE table is keyed by the exact expert shape). The fixed
overheads (kernel gaps, iteration overhead, eager launches) are :class:`sim.config.CostConfig`'s.
Measured kernel times are isolated kernel benchmarks: ``sustained_efficiency`` is not applied to them.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from moeplace.foundation.cluster import ClusterSpec
from moeplace.foundation.errors import InputError
from moeplace.foundation.model import ModelSpec
from moeplace.sim.calibration import Profile
from moeplace.sim.config import COST_ENGINES as FRAMEWORKS
from moeplace.sim.config import COST_MODELS, CostConfig, EngineConfig
from moeplace.sim.cost import CostModel, MoeWork, RankWork

# moeplace GPU preset -> aiconfigurator system (H800 has no tables)
SYSTEMS = {"h100": "h100_sxm", "h200": "h200_sxm", "b200": "b200_sxm", "b300": "b300_sxm",
           "gb200-nvl72": "gb200", "gb300-nvl72": "gb300"}
GEMM_QUANT = {"bf16": "bfloat16", "fp8": "fp8", "fp8_block128": "fp8_block", "nvfp4": "nvfp4"}
MOE_QUANT = {"bf16": "bfloat16", "fp8": "fp8", "fp8_block128": "fp8_block", "nvfp4": "nvfp4",
             "mxfp4": "w4a16_mxfp4"}
# compute dtype of each MoE quant mode (its peak bounds what a table row can mean): W4A16 runs BF16 math
MOE_COMPUTE = {"bfloat16": "bf16", "fp8": "fp8", "fp8_block": "fp8", "nvfp4": "nvfp4", "w4a16_mxfp4": "bf16"}
TOKENS = np.unique(np.round(np.geomspace(1, 65536, 25))).astype(int)  # token grid of the 1-D curves
ROWS = np.unique(np.round(np.geomspace(1, 4096, 25))).astype(int)  # rows per expert of the experts curve
DEC_BATCH = np.array([1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024])
DEC_CTX = np.array([64, 256, 1024, 4096, 16384, 65536, 131072])
PRE_LEN = np.array([16, 64, 256, 1024, 4096, 16384])
PRE_PREFIX = np.array([0, 1024, 4096, 16384, 65536])
KDA_BATCH = np.array([1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024])
KDA_CHUNK = np.array([16, 64, 256, 1024, 4096, 16384])
EP_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MESSAGE_BYTES = np.geomspace(2 ** 12, 2 ** 31, 20)  # collective message grid
_COMM_ELEMS = 1024  # elements per "token" of the NCCL op when building byte curves (BF16: 2 KiB)
_PROBE_TOKENS = 8192  # token count at which two EP sizes of the MoE table are compared
_CURVES = ("_experts", "_proj", "_trunk", "_head", "_mla_dec", "_mla_pre", "_kda_dec", "_kda_pre", "_allreduce",
           "_gather")
_BUILT: dict[tuple, tuple[dict, dict]] = {}


def package_version() -> str | None:
    """The installed aiconfigurator-core version, or None when it is not installed."""
    try:
        from importlib.metadata import PackageNotFoundError, version
        return version("aiconfigurator-core")
    except PackageNotFoundError:
        return None


# KDA kernels by aiconfigurator framework, as its Kimi K3 model picks them: (decode, prefill) kernel names;
# None: the other frameworks' (FLA's chunked kernels)
KDA_KERNELS: dict[str | None, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "vllm": (("fused_kda_decode",), ("causal_conv1d_fn_qkv3", "flashkda_fwd")),
    None: (("causal_conv1d_update", "fused_recurrent_kda_packed_decode"), ("causal_conv1d_fn_qkv3", "chunk_kda")),
}


@dataclass
class Curve:
    """Seconds at increasing ``x`` (> 0), interpolated log-log; below the grid the first value (kernels
    do not get faster than their latency), above it proportional to ``x`` (throughput bound)."""

    x: np.ndarray
    y: np.ndarray
    label: str

    def __call__(self, x) -> np.ndarray:
        xv = np.maximum(np.asarray(x, dtype=np.float64), self.x[0])
        inside = np.exp(np.interp(np.log(xv), np.log(self.x), np.log(self.y)))
        return np.where(xv > self.x[-1], self.y[-1] * xv / self.x[-1], inside)


@dataclass
class Grid2:
    """Seconds on a ``a x b`` grid, bilinear in (log a, log1p b); clamped to the grid on both axes except
    proportional above the last ``a`` (more sequences: proportionally more work)."""

    a: np.ndarray
    b: np.ndarray
    y: np.ndarray  # [len(a), len(b)]
    label: str

    def __call__(self, a, b) -> np.ndarray:
        av = np.maximum(np.asarray(a, dtype=np.float64), self.a[0])
        bv = np.clip(np.asarray(b, dtype=np.float64), self.b[0], self.b[-1])
        la, lb = np.log(np.minimum(av, self.a[-1])), np.log1p(bv)
        ga, gb = np.log(self.a), np.log1p(self.b)
        i = np.clip(np.searchsorted(ga, la) - 1, 0, len(ga) - 2)
        j = np.clip(np.searchsorted(gb, lb) - 1, 0, len(gb) - 2)
        fa = np.clip((la - ga[i]) / (ga[i + 1] - ga[i]), 0, 1)
        fb = np.clip((lb - gb[j]) / (gb[j + 1] - gb[j]), 0, 1)
        ly = np.log(self.y)
        v = ((1 - fa) * (1 - fb) * ly[i, j] + fa * (1 - fb) * ly[i + 1, j] + (1 - fa) * fb * ly[i, j + 1]
             + fa * fb * ly[i + 1, j + 1])
        return np.exp(v) * np.maximum(av / self.a[-1], 1.0)


class Tables:
    """aiconfigurator's tables of one (system, framework, version): single-op queries, in seconds."""

    def __init__(self, system: str, framework: str, version: str) -> None:
        from aiconfigurator_core.sdk import common, perf_database  # only for measured cost models
        from aiconfigurator_core.sdk import operations as ops  # only for measured cost models
        from aiconfigurator_core.sdk.engine import EngineHandle, build_ops_json  # only for measured costs

        self.system, self.framework, self.version = system, framework, version
        self.common, self.ops, self._json = common, ops, build_ops_json
        self.db = perf_database.get_database(system, framework, version)
        if self.db is None:
            raise InputError(f"aiconfigurator has no {framework} {version} tables for {system}")
        self.handle = EngineHandle.for_database(self.db)
        self.num_gpus_per_node = int(self.db.system_spec["node"]["num_gpus_per_node"])

    @property
    def name(self) -> str:
        return f"aiconfigurator {self.system}/{self.framework} {self.version}"

    def query(self, op_list: list, *, context: bool = False, batch: int = 1, s: int = 1, x: int | None = None,
              prefix: int = 0) -> tuple[float, str]:
        """Seconds of the ops run back to back and the worst source that priced them (``silicon`` when
        every op was a table value); raises what aiconfigurator raises when it cannot price them."""
        res = self.handle.evaluate_ops_json(self._json(op_list), is_context=context, batch_size=int(batch),
                                            s=int(s), prefix=int(prefix), x=None if x is None else int(x))
        srcs = {r[3] for r in res}
        prov = self.handle.last_provenance()
        src = "silicon" if srcs == {"silicon"} and not prov else "+".join(sorted(srcs | ({prov} if prov else set())))
        return sum(r[1] for r in res) / 1e3, src


@functools.lru_cache(maxsize=16)
def tables_for(system: str, framework: str, version: str) -> Tables:
    return Tables(system, framework, version)


def resolve_tables(gpu: str, framework: str, version: str | None = None) -> tuple[Tables | None, str]:
    """The tables for a run on ``gpu`` served by ``framework`` (``version``: aiconfigurator's ``current``
    release of that framework for that GPU when None), or ``(None, why not)``."""
    if package_version() is None:
        return None, "aiconfigurator-core is not installed"
    system = SYSTEMS.get(gpu)
    if system is None:
        return None, f"aiconfigurator has no tables for GPU '{gpu}' (it covers {', '.join(SYSTEMS)})"
    if framework not in FRAMEWORKS:
        return None, f"aiconfigurator has no tables for engine '{framework}' (expected one of {FRAMEWORKS})"
    logging.getLogger("aiconfigurator_core").setLevel(logging.ERROR)
    from aiconfigurator_core.sdk import perf_database  # loaded only for measured cost models

    try:
        ver = perf_database.resolve_query_version(system, framework, version or "current")
        return tables_for(system, framework, ver), ""
    except (ValueError, InputError, OSError) as exc:
        return None, f"aiconfigurator has no {framework} {version or 'current'} tables for {system}: {exc}"


class MeasuredCostModel(CostModel):
    """:class:`sim.cost.CostModel` with each term priced by aiconfigurator's tables where they hold it
    (see the module docstring); :attr:`terms` maps every term to the source that priced it."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, tables: Tables, cfg: CostConfig | None = None,
                 **kw: Any) -> None:
        super().__init__(model, cluster, cfg, **kw)
        self.tables = tables
        self.terms: dict[str, str] = {}
        q = tables.common
        self._gq = getattr(q.GEMMQuantMode, GEMM_QUANT.get(model.weight_dtype, "bfloat16"))
        self._kv = getattr(q.KVCacheQuantMode, "fp8" if self.kv_dtype == "fp8" else "bfloat16")
        self._fmha = getattr(q.FMHAQuantMode, "fp8" if kw.get("attention_dtype") == "fp8" else "bfloat16")
        key = (tables.name, model, self.tp, self.moe_tp, self.kv_dtype, kw.get("attention_dtype"), self.a2a_mode,
               cluster.num_gpus, cluster.gpus_per_node)
        if key not in _BUILT:  # the tables are queried once per process and configuration
            self._build()
            _BUILT[key] = ({k: getattr(self, k) for k in _CURVES}, dict(self.terms))
        curves, terms = _BUILT[key]
        for k, v in curves.items():
            setattr(self, k, v)
        self.terms = dict(terms)

    def _build(self) -> None:
        model, tables, q = self.model, self.tables, self.tables.common
        self._experts = self._expert_curve()
        if self._experts is None:  # the run is not covered (make_cost_model falls back): nothing else to query
            for k in _CURVES[1:]:
                setattr(self, k, {} if k == "_proj" else {True: None, False: None} if k == "_trunk" else None)
            return
        self._proj = {k: self._gemm_curve(f"projections:{k}", self._projection_gemms(k)) for k in self._att_params}
        self._trunk = {True: self._gemm_curve("trunk:moe", self._trunk_gemms(True)) if model.num_moe_layers else None,
                       False: self._gemm_curve("trunk:dense", self._trunk_gemms(False))
                       if model.num_layers > model.num_moe_layers else None}
        self._head = self._gemm_curve("lm_head", [tables.ops.GEMM("lm_head", 1, max(1, model.vocab_size // self.tp),
                                                                   model.hidden_size, q.GEMMQuantMode.bfloat16)])
        self._mla_dec, self._mla_pre = self._mla_grids() if self.kind_counts["mla"] else (None, None)
        self._kda_dec, self._kda_pre = self._kda_curves() if self.kind_counts["kda"] else (None, None)
        self._allreduce = self._allreduce_curve() if self.tp > 1 else None
        self._gather = self._gather_curves()
        if not self.pure_tp and self.a2a_mode != "allgather":
            self.terms["dispatch/combine"] = "roofline: no per-GPU-load all-to-all table (DeepEP kernels)"
        if self.kind_counts["gqa"]:
            self.terms["gqa_core"] = "roofline"
        self.terms["transfers"] = "roofline"

    # ------------------------------------------------------------------ building the curves
    def _measure(self, term: str, build):
        """``build()`` -> (curve, source); on aiconfigurator's refusal the term keeps the roofline."""
        try:
            curve, src = build()
        except Exception as exc:  # noqa: BLE001 - any refusal of aiconfigurator's: roofline, labelled
            msg = " ".join(str(exc).split())[:160]
            self.terms[term] = f"roofline: {self.tables.name} cannot price it ({type(exc).__name__}: {msg})"
            return None
        self.terms[term] = f"{self.tables.name} ({src})"
        return curve

    def _gemm_curve(self, term: str, gemms: list) -> Curve | None:
        if not gemms:
            return None

        def build():
            ys, srcs = [], set()
            for x in TOKENS:
                t, src = self.tables.query(gemms, context=True, x=int(x))
                ys.append(t)
                srcs.add(src)
            return Curve(TOKENS.astype(np.float64), np.maximum(np.array(ys), 1e-9), term), "+".join(sorted(srcs))

        return self._measure(term, build)

    def _projection_gemms(self, kind: str) -> list:
        m, tp, G = self.model, self.tp, self.tables.ops.GEMM
        h, q = m.hidden_size, self._gq
        if kind == "mla":
            c = m.mla
            qk = c.qk_nope_head_dim + c.qk_rope_head_dim
            down = (c.q_lora_rank or 0) + c.kv_lora_rank + c.qk_rope_head_dim  # fused q_a + kv_a (replicated)
            out = [G("qkv_a", 1, down, h, q)]
            if c.q_lora_rank:
                out.append(G("q_b", 1, max(1, c.num_heads * qk // tp), c.q_lora_rank, q))
            else:
                out.append(G("q", 1, max(1, c.num_heads * qk // tp), h, q))
            out.append(G("kv_b", 1, max(1, c.num_heads * (c.qk_nope_head_dim + c.v_head_dim) // tp), c.kv_lora_rank, q))
            out.append(G("o", 1, h, max(1, c.num_heads * c.v_head_dim // tp), q))
            if c.output_gate:
                out.append(G("gate", 1, max(1, c.num_heads * c.v_head_dim // tp), h, q))
            return out
        n = max(1, round(m.attention_params(kind) / tp / h))  # one GEMM of the block's parameters
        return [G(f"{kind}_proj", 1, n, h, q)]

    def _trunk_gemms(self, moe: bool) -> list:
        m, tp, G, q = self.model, self.tp, self.tables.ops.GEMM, self._gq
        h = m.hidden_size
        if not moe:
            i = max(1, m.dense_intermediate_size // tp)
            return [G("mlp_gate_up", 1, 2 * i, h, q), G("mlp_down", 1, h, i, q)]
        out = [G("router", 1, m.num_experts, h, self.tables.common.GEMMQuantMode.bfloat16)]
        if m.num_shared_experts:
            i = max(1, m.num_shared_experts * m.shared_intermediate_size // tp)
            out += [G("shared_gate_up", 1, 2 * i, h, q), G("shared_down", 1, h, i, q)]
        if m.expert_hidden_size != h:
            out += [G("latent_down", 1, m.expert_hidden_size, h, q), G("latent_up", 1, h, m.expert_hidden_size, q)]
        return out

    def _expert_curve(self) -> Curve | None:
        m = self.model
        qname = MOE_QUANT.get(m.expert_dtype)
        if qname is None:
            self.terms["experts"] = f"roofline: no MoE quant mode for expert dtype '{m.expert_dtype}'"
            return None
        quant = getattr(self.tables.common.MoEQuantMode, qname)
        G = self.cluster.num_gpus // self.moe_tp
        eps = sorted((e for e in EP_SIZES if m.num_experts % e == 0),
                     key=lambda e: (abs(np.log(e / max(G, 1))), -e))
        E, k = m.num_experts, m.top_k

        def op(ep):
            return self.tables.ops.MoE("moe", 1, m.expert_hidden_size, m.moe_intermediate_size, k, E, self.moe_tp, ep,
                                       quant, "balanced", 1)

        ep, errors = None, []
        for e in eps:  # the EP size nearest the pool's that the table holds
            try:
                self.tables.query([op(e)], x=_PROBE_TOKENS)
            except Exception as exc:  # noqa: BLE001 - the table lacks this EP size
                errors.append(f"EP{e}: {type(exc).__name__}")
                continue
            ep = e
            break
        if ep is None:
            self.terms["experts"] = (f"roofline: {self.tables.name} holds no MoE table for {E} experts top-{k} "
                                     f"{m.expert_hidden_size}x{m.moe_intermediate_size} {qname} TP{self.moe_tp} "
                                     f"({', '.join(errors[:3])})")
            return None
        n_loc = E // ep
        # What the table's token count means differs between collectors: the pool's tokens (the table's GPU
        # serves x k / ep selections) or the tokens reaching the GPU (x k selections over its E / ep local
        # experts); the readings differ by ep x in speed. Rule: the faster reading that does not make the GPU
        # beat its own peak FLOP rate at the largest row count (a grouped GEMM there is compute bound).
        peak = self.gpu.flops(MOE_COMPUTE.get(qname, m.expert_dtype))
        best = None
        for per_gpu in (True, False):
            ys, srcs = [], set()
            for rows in ROWS:  # every local expert touched at `rows` rows each
                x = max(1, round(rows * n_loc / k if per_gpu else rows * E / k))
                t, src = self.tables.query([op(ep)], x=x)
                ys.append(t / n_loc)
                srcs.add(src)
            rate = self.expert_flops_per_token * ROWS[-1] / ys[-1]
            if rate <= peak and (best is None or rate > best[0]):
                best = (rate, per_gpu, ys, srcs)
        if best is None:
            self.terms["experts"] = (f"roofline: {self.tables.name}'s MoE table {qname} at EP{ep} implies more than "
                                     "the GPU's peak FLOP rate under either reading of its token count")
            return None
        _, per_gpu, ys, srcs = best
        meaning = "tokens reaching the GPU" if per_gpu else "the pool's tokens"
        self.terms["experts"] = (f"{self.tables.name} ({'+'.join(sorted(srcs))}), MoE table {qname} at EP{ep} "
                                 f"TP{self.moe_tp} (its token count read as {meaning}), per touched expert; each "
                                 "GPU at its own tokens and touched experts")
        return Curve(ROWS.astype(np.float64), np.maximum(np.array(ys), 1e-9), "experts")

    def _mla_grids(self) -> tuple[Grid2 | None, Grid2 | None]:
        heads = max(1, self.model.mla.num_heads // self.tp)
        ops = self.tables.ops

        def dec():
            op = ops.GenerationMLA("mla_decode", 1, heads, self._kv)
            y, srcs = np.zeros((len(DEC_BATCH), len(DEC_CTX))), set()
            for i, b in enumerate(DEC_BATCH):
                for j, s in enumerate(DEC_CTX):
                    y[i, j], src = self.tables.query([op], context=False, batch=int(b), s=int(s))
                    srcs.add(src)
            return Grid2(DEC_BATCH.astype(float), DEC_CTX.astype(float), np.maximum(y, 1e-9), "mla_decode"), \
                "+".join(sorted(srcs))

        def pre():
            op = ops.ContextMLA("mla_prefill", 1, heads, self._kv, self._fmha)
            y, srcs = np.zeros((len(PRE_LEN), len(PRE_PREFIX))), set()
            for i, s in enumerate(PRE_LEN):
                for j, p in enumerate(PRE_PREFIX):
                    y[i, j], src = self.tables.query([op], context=True, batch=1, s=int(s), prefix=int(p))
                    srcs.add(src)
            return Grid2(PRE_LEN.astype(float), PRE_PREFIX.astype(float), np.maximum(y, 1e-9), "mla_prefill"), \
                "+".join(sorted(srcs))

        return self._measure("mla_decode", dec), self._measure("mla_prefill", pre)

    def _kda_curves(self) -> tuple[Curve | None, Curve | None]:
        """KDA's kernels from the KDA table (the engine's own kernels, as aiconfigurator's Kimi K3 model picks
        them): decode per decoding sequence count, prefill per chunk of a given length."""
        c, ops = self.model.kda, self.tables.ops
        h, nk = self.model.hidden_size, max(1, c.num_heads // self.tp)
        dec_names, pre_names = KDA_KERNELS.get(self.tables.framework, KDA_KERNELS[None])

        def kernels(names, phase):
            return [ops.KDAKernel(f"kda_{n}", 1, n, phase, h, nk, c.head_dim, nk, c.head_dim, c.conv_kernel)
                    for n in names]

        dec_ops = kernels(dec_names, "generation")
        pre_ops = kernels(pre_names, "context")

        def curve(term, op_list, grid, context):
            def build():
                ys, srcs = [], set()
                for v in grid:
                    t, src = (self.tables.query(op_list, context=True, batch=1, s=int(v)) if context
                              else self.tables.query(op_list, context=False, batch=int(v), s=1))
                    ys.append(t)
                    srcs.add(src)
                return Curve(grid.astype(np.float64), np.maximum(np.array(ys), 1e-9), term), "+".join(sorted(srcs))
            return self._measure(term, build)

        return curve("kda_decode", dec_ops, KDA_BATCH, False), curve("kda_prefill", pre_ops, KDA_CHUNK, True)

    def _allreduce_curve(self) -> Curve | None:
        op = self.tables.ops.CustomAllReduce("allreduce", 1, self.model.hidden_size, self.tp)

        def build():
            ys, srcs = [], set()
            for x in TOKENS:
                t, src = self.tables.query([op], context=True, x=int(x))
                ys.append(t)
                srcs.add(src)
            return Curve(TOKENS.astype(np.float64), np.maximum(np.array(ys), 1e-9), "allreduce"), "+".join(sorted(srcs))

        return self._measure("allreduce", build)

    def _gather_curves(self) -> tuple[Curve, Curve] | None:
        if self.a2a_mode != "allgather" or self.pure_tp:
            return None
        G = self.cluster.num_gpus
        if G > min(self.cluster.gpus_per_node, self.tables.num_gpus_per_node):
            self.terms["allgather"] = (f"roofline: the EP group of {G} GPUs spans nodes of "
                                       f"{self.tables.num_gpus_per_node} GPUs in {self.tables.system}'s tables")
            return None
        c = self.tables.common.CommQuantMode.half

        def build():
            out, srcs = [], set()
            for opname in ("all_gather", "reduce_scatter"):
                op = self.tables.ops.NCCL(opname, 1, opname, _COMM_ELEMS, G, c)
                ys = []
                for b in MESSAGE_BYTES:
                    t, src = self.tables.query([op], context=True, x=max(1, int(b / (2 * _COMM_ELEMS))))
                    ys.append(t)
                    srcs.add(src)
                out.append(Curve(MESSAGE_BYTES, np.maximum(np.array(ys), 1e-9), opname))
            return tuple(out), "+".join(sorted(srcs)) + f", NCCL all-gather + reduce-scatter over {G} GPUs"

        return self._measure("allgather", build)

    # ------------------------------------------------------------------ the measured terms
    def expert_time(self, tokens, touched, shard: int = 1):
        if self._experts is None or shard != self.moe_tp or (self.profile is not None
                                                             and self.profile.has("expert_gemm")):
            return super().expert_time(tokens, touched, shard)
        tokens = np.asarray(tokens, dtype=np.float64)
        touched = np.asarray(touched, dtype=np.float64)
        per = np.divide(tokens, touched, out=np.ones_like(tokens), where=touched > 0)
        return np.where(touched > 0, touched * self._experts(np.maximum(per, 1.0)), 0.0)

    def _projections(self, kind: str, w: RankWork, kernels: int):
        curve = self._proj.get(kind)
        if curve is None:
            return super()._projections(kind, w, kernels)
        return np.where(w.tokens > 0, curve(np.maximum(w.tokens, 1.0)), 0.0)

    def mla_time(self, w: RankWork):
        if self._mla_dec is None or self._mla_pre is None:
            return super().mla_time(w)
        dec_tokens = np.maximum(w.tokens - w.pre_tokens, 0.0)
        ctx = np.divide(w.dec_ctx, dec_tokens, out=np.zeros_like(w.dec_ctx), where=dec_tokens > 0)
        dec = np.where(w.dec_seqs > 0, self._mla_dec(np.maximum(w.dec_seqs, 1.0), ctx), 0.0)
        chunk = np.divide(w.pre_tokens, w.pre_seqs, out=np.zeros_like(w.pre_tokens), where=w.pre_seqs > 0)
        prefix = np.maximum(np.divide(w.pre_ctx, w.pre_seqs, out=np.zeros_like(w.pre_ctx), where=w.pre_seqs > 0)
                            - chunk, 0.0)
        pre = np.where(w.pre_seqs > 0, w.pre_seqs * self._mla_pre(np.maximum(chunk, 1.0), prefix), 0.0)
        return self._projections("mla", w, 4) + dec + pre

    def kda_time(self, w: RankWork):
        if self._kda_dec is None or self._kda_pre is None:
            return super().kda_time(w)
        dec = np.where(w.dec_seqs > 0, self._kda_dec(np.maximum(w.dec_seqs, 1.0)), 0.0)
        chunk = np.divide(w.pre_tokens, w.pre_seqs, out=np.zeros_like(w.pre_tokens), where=w.pre_seqs > 0)
        pre = np.where(w.pre_seqs > 0, w.pre_seqs * self._kda_pre(np.maximum(chunk, 1.0)), 0.0)
        return self._projections("kda", w, 4) + dec + pre

    def trunk_time(self, w: RankWork, moe: bool):
        curve = self._trunk[moe]
        if curve is None:
            return super().trunk_time(w, moe)
        return np.where(w.tokens > 0, curve(np.maximum(w.tokens, 1.0)), 0.0)

    def lm_head_time(self, w: RankWork):
        if self._head is None:
            return super().lm_head_time(w)
        return np.where(w.sampled > 0, self._head(np.maximum(w.sampled, 1.0)), 0.0)

    def allreduce_time(self, tokens):
        if self._allreduce is None:
            return super().allreduce_time(tokens)
        t = np.asarray(tokens, dtype=np.float64)
        return np.where(t > 0, self._allreduce(np.maximum(t, 1.0)), 0.0)

    def moe_layer_times(self, moe: MoeWork, mode: str = "low_latency", link_share=None):
        experts, comm, strag = super().moe_layer_times(moe, mode, link_share)
        if mode == "allgather" and self._gather is not None and not self.pure_tp:
            ag, rs = self._gather
            tok = moe.tokens.sum(axis=1) / self.model.top_k  # the pool's tokens per layer: the gathered output
            slow = 1.0 if link_share is None else float(np.max(link_share[0]))
            comm = np.where(tok > 0, (ag(tok * self.allgather_bytes()) + rs(tok * self.copy_bytes("combine"))) * slow,
                            0.0)
        return experts, comm, strag


def make_cost_model(model: ModelSpec, cluster: ClusterSpec, cfg: CostConfig | None, engine: EngineConfig,
                    profile: Profile | None = None, cost_model: str = "roofline", framework: str | None = None,
                    version: str | None = None) -> CostModel:
    """The cost model of one engine configuration: measured (:class:`MeasuredCostModel`) or roofline
    (:class:`sim.cost.CostModel`). ``auto``: measured where aiconfigurator's tables cover the GPU and engine
    and price the routed experts (the model's expert shape and dtype), else roofline; ``measured``: the
    same, an error when they do not. ``framework``: the serving engine whose tables price the run (default
    the replica rule's engine). The chosen source and why are in :func:`cost_source`."""
    if cost_model not in COST_MODELS:
        raise InputError(f"--cost-model '{cost_model}' unknown (expected one of {COST_MODELS})")
    e = engine
    kw = {"profile": profile, **CostModel.engine_kwargs(e)}
    if cost_model == "roofline":
        cost = CostModel(model, cluster, cfg, **kw)
        cost.cost_source = {"source": "roofline", "requested": cost_model}
        return cost
    framework = framework or e.replica_rule
    tables, why = resolve_tables(cluster.gpu.name, framework, version)
    if tables is not None:
        cost = MeasuredCostModel(model, cluster, tables, cfg, **kw)
        if cost._experts is not None:
            cost.cost_source = {"source": "measured", "requested": cost_model, "tables": tables.name,
                                "package": f"aiconfigurator-core {package_version()}", "terms": dict(cost.terms)}
            return cost
        why = cost.terms["experts"].removeprefix("roofline: ")
    if cost_model == "measured":
        raise InputError(f"--cost-model measured: {why}")
    cost = CostModel(model, cluster, cfg, **kw)
    cost.cost_source = {"source": "roofline", "requested": cost_model, "why": why}
    return cost


def cost_source(cost: CostModel) -> dict[str, Any]:
    """Which source priced a cost model's terms (``summary.cost_model``)."""
    return dict(getattr(cost, "cost_source", None) or {"source": "roofline", "requested": "roofline"})


def cost_source_line(doc: dict[str, Any]) -> str:
    """One line naming the cost source of a run (printed under ``place simulate``'s header)."""
    if doc["source"] == "measured":
        roof = sorted(t for t, s in doc["terms"].items() if s.startswith("roofline"))
        return (f"cost model: measured ({doc['tables']}, {doc['package']}); roofline for "
                f"{', '.join(roof) or 'nothing'} (--json: cost_model.terms)")
    why = f": {doc['why']}" if doc.get("why") else ""
    return f"cost model: roofline{why}"
