"""Serving-benchmark result files, as the released tools write them, read into measured points for
``place calibrate``.

- vLLM 0.34.0 ``vllm bench serve --save-result`` (vllm/benchmarks/serve.py ``main_async``): one JSON object
  per file (``--append-result`` appends one object per line). Fields read: ``max_concurrency`` (null:
  no limit), ``request_rate`` (a number or ``"inf"``), ``num_prompts``, ``completed``, ``duration``,
  ``total_input_tokens``, ``total_output_tokens``, ``output_throughput``, ``total_token_throughput``,
  ``median_ttft_ms``, ``median_tpot_ms``, ``median_itl_ms``; ``input_lens`` / ``output_lens`` when saved
  with ``--save-detailed``; ``spec_decode_acceptance_length`` when the server exposed it.
- SGLang 0.5.23 ``python -m sglang.bench_serving --output-file`` (sglang/benchmark/serving.py): JSONL, one
  object per run. Same names where they agree, ``total_throughput`` for the total token rate,
  ``random_input_len`` / ``random_output_len`` / ``random_range_ratio`` as configured, ``accept_length``.
- NVIDIA AIPerf 0.13 ``aiperf profile`` export ``profile_export_aiperf.json`` (schema 1.4): each metric an
  object of statistics (``avg``, ``p50``, ...) with its ``unit``; the load from the profiling phase in
  ``input_config.phases`` (``concurrency`` or ``request_rate``).

Lengths and concurrency come from the file itself (mean prompt and output tokens per completed request;
the configured concurrency); the deployment does not (``sim.calibrate.Deployment``). Every problem is one
line naming the file (and line of a JSONL file) and the field.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moeplace.foundation.errors import InputError
from moeplace.foundation.reading import is_int, json_lines, parse_json, quote, read_bytes

VLLM, SGLANG, AIPERF = "vllm bench serve", "sglang bench_serving", "aiperf"
# fields only one tool writes, any of which tells its result from the others' (its metrics are then
# checked field by field, so a damaged file is named by the field it lacks)
_MARKERS = {AIPERF: ("aiperf_version", "output_token_throughput", "input_config"),
            SGLANG: ("random_input_len", "total_throughput", "server_info", "sharegpt_output_len"),
            VLLM: ("total_token_throughput", "endpoint_type", "tokenizer_id", "request_goodput")}


@dataclass(frozen=True)
class MeasuredPoint:
    """One benchmark run: its load and what it measured. ``concurrency``: requests kept in flight (the
    configured limit; every request at once when the run had none); ``rate``: requests/s of an open-loop run
    (None for a closed loop); ``isl`` / ``osl``: mean prompt and output tokens per completed request;
    ``range_ratio``: the spread of the prompt lengths (max - min) / (max + min) when the file lists them;
    throughputs in tokens/s of the whole deployment; times in seconds (medians); ``accept_length``: tokens
    per decode step the server reported under speculative decoding (None when it did not)."""

    source: str
    tool: str
    concurrency: int
    rate: float | None
    num_requests: int
    duration_s: float
    isl: float
    osl: float
    range_ratio: float
    output_tok_s: float
    total_tok_s: float | None
    ttft_s: float | None
    tpot_s: float | None
    itl_s: float | None
    accept_length: float | None

    def describe(self) -> str:
        load = f"concurrency {self.concurrency}" if self.rate is None else f"{self.rate:g} req/s"
        return (f"{self.source}: {self.tool}, {load}, ISL {self.isl:,.0f} / OSL {self.osl:,.0f}, "
                f"{self.output_tok_s:,.1f} output tok/s"
                + (f", TPOT {self.tpot_s * 1e3:.2f} ms" if self.tpot_s else ""))


def _where(path: Path, line: int | None) -> str:
    return f"{path}:{line}" if line is not None else str(path)


class _Fields:
    """Typed access to one result object, each error naming the file (and line) and the field."""

    def __init__(self, obj: dict[str, Any], where: str, tool: str) -> None:
        self.obj, self.where, self.tool = obj, where, tool

    def err(self, key: str, what: str) -> InputError:
        return InputError(f"{self.where}: field '{key}' {what}")

    def number(self, key: str, *, required: bool = True, positive: bool = False, nonneg: bool = True):
        if key not in self.obj or self.obj[key] is None:
            if required:
                raise self.err(key, f"missing (a {self.tool} result has it)")
            return None
        v = self.obj[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise self.err(key, f"is {quote(v)}, expected a finite number")
        if positive and not v > 0:
            raise self.err(key, f"is {quote(v)}, expected a number > 0")
        if nonneg and v < 0:
            raise self.err(key, f"is {quote(v)}, expected a number >= 0")
        return float(v)

    def count(self, key: str, *, required: bool = True) -> int | None:
        v = self.obj.get(key)
        if v is None:
            if required:
                raise self.err(key, f"missing (a {self.tool} result has it)")
            return None
        if not is_int(v) or v < 1:
            raise self.err(key, f"is {quote(v)}, expected a whole number >= 1")
        return int(v)

    def lengths(self, key: str) -> list[int] | None:
        v = self.obj.get(key)
        if v is None:
            return None
        if not isinstance(v, list) or not all(is_int(x) and x >= 0 for x in v):
            raise self.err(key, "expected a list of token counts (whole numbers >= 0)")
        return [int(x) for x in v]

    def rate(self, key: str = "request_rate") -> float | None:
        """Requests/s of an open-loop run; None for ``inf`` (every request at once)."""
        v = self.obj.get(key)
        if v is None or v == "inf" or v == float("inf"):
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise self.err(key, f"is {quote(v)}, expected a number of requests/s > 0 or \"inf\"")
        return float(v)


def _ms(f: _Fields, key: str) -> float | None:
    v = f.number(key, required=False)
    return None if v is None or v == 0 else v / 1e3


def _spread(lens: list[int] | None) -> float:
    if not lens:
        return 0.0
    lo, hi = min(lens), max(lens)
    return (hi - lo) / (hi + lo) if hi + lo else 0.0


def _point(f: _Fields, total_key: str, accept_key: str) -> MeasuredPoint:
    """A vLLM or SGLang result object (the two share their field names but for the total rate and the
    acceptance length)."""
    completed = f.count("completed")
    duration = f.number("duration", positive=True)
    total_in = f.number("total_input_tokens")
    total_out = f.number("total_output_tokens", positive=True)
    out_rate = f.number("output_throughput", positive=True)
    total_rate = f.number(total_key, required=False)
    conc = f.count("max_concurrency", required=False)
    rate = f.rate()
    num = f.count("num_prompts", required=False) or completed
    if conc is None and rate is None:
        conc = num  # no limit and every request sent at once: all of them in flight
    if conc is not None:
        rate = None  # a concurrency limit keeps the run closed while the sender keeps up (benchmarks do)
    in_lens, out_lens = f.lengths("input_lens"), f.lengths("output_lens")
    if in_lens is not None and out_lens is not None and len(in_lens) != len(out_lens):
        raise f.err("output_lens", f"has {len(out_lens)} entries, 'input_lens' {len(in_lens)}")
    ttft = _ms(f, "median_ttft_ms")
    tpot = _ms(f, "median_tpot_ms")
    itl = _ms(f, "median_itl_ms")
    if ttft is None and tpot is None:
        raise f.err("median_tpot_ms", "missing, and so is 'median_ttft_ms' (the run measured no latency)")
    acc = f.number(accept_key, required=False)
    return MeasuredPoint(source=f.where, tool=f.tool, concurrency=conc or 0, rate=rate, num_requests=completed,
                         duration_s=duration, isl=total_in / completed, osl=total_out / completed,
                         range_ratio=_spread(in_lens), output_tok_s=out_rate, total_tok_s=total_rate,
                         ttft_s=ttft, tpot_s=tpot, itl_s=itl, accept_length=acc if acc and acc >= 1 else None)


def _stat(f: _Fields, key: str, stat: str, *, required: bool = True) -> tuple[float, str] | None:
    """``(value, unit)`` of an AIPerf metric's statistic."""
    m = f.obj.get(key)
    if m is None:
        if required:
            raise f.err(key, "missing (an AIPerf export has it)")
        return None
    if not isinstance(m, dict) or stat not in m:
        raise f.err(key, f"expected an object with '{stat}' and 'unit'")
    v = m[stat]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise f.err(f"{key}.{stat}", f"is {quote(v)}, expected a finite number >= 0")
    return float(v), str(m.get("unit", ""))


_TIME_UNITS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, "sec": 1.0}


def _seconds(f: _Fields, key: str, stat: str = "p50") -> float | None:
    got = _stat(f, key, stat, required=False)
    if got is None:
        return None
    v, unit = got
    if unit not in _TIME_UNITS:
        raise f.err(f"{key}.unit", f"is {quote(unit)}, expected one of {', '.join(_TIME_UNITS)}")
    return v * _TIME_UNITS[unit] or None


def _aiperf_load(f: _Fields) -> tuple[int | None, float | None]:
    """(concurrency, request rate) of the profiling phase AIPerf 0.13 records in ``input_config.phases``."""
    cfg = f.obj.get("input_config")
    phases = cfg.get("phases") if isinstance(cfg, dict) else None
    if not isinstance(phases, list):
        raise f.err("input_config.phases", "missing (an AIPerf export records the load it ran there)")
    prof = [p for p in phases if isinstance(p, dict) and p.get("kind") == "profiling"]
    if len(prof) != 1:
        raise f.err("input_config.phases", f"has {len(prof)} profiling phases, expected one")
    lg = _Fields(prof[0], f"{f.where}: input_config.phases[profiling]", f.tool)
    conc, rate = lg.count("concurrency", required=False), lg.rate("request_rate")
    if conc is None and rate is None:
        raise f.err("input_config.phases[profiling].concurrency", "missing, and no request_rate either")
    return conc, rate


def _aiperf_point(f: _Fields) -> MeasuredPoint:
    conc, rate = _aiperf_load(f)
    completed = int(_stat(f, "request_count", "avg")[0])
    if completed < 1:
        raise f.err("request_count.avg", "is 0: no request completed")
    isl = _stat(f, "input_sequence_length", "avg")[0]
    osl = _stat(f, "output_sequence_length", "avg")[0]
    out_rate = _stat(f, "output_token_throughput", "avg")[0]
    if not out_rate > 0:
        raise f.err("output_token_throughput.avg", "is 0, expected a throughput > 0")
    dur = _stat(f, "benchmark_duration", "avg", required=False)
    duration = dur[0] * _TIME_UNITS.get(dur[1], 1.0) if dur else completed * osl / out_rate
    return MeasuredPoint(source=f.where, tool=f.tool, concurrency=conc or 0, rate=None if conc else rate,
                         num_requests=completed, duration_s=duration, isl=isl, osl=osl, range_ratio=0.0,
                         output_tok_s=out_rate, total_tok_s=None, ttft_s=_seconds(f, "time_to_first_token"),
                         tpot_s=_seconds(f, "inter_token_latency"), itl_s=_seconds(f, "inter_token_latency"),
                         accept_length=None)


def tool_of(obj: Any) -> str | None:
    """Which tool wrote a result object, by the fields each writes (None: none of them)."""
    if not isinstance(obj, dict):
        return None
    for tool, keys in _MARKERS.items():
        if any(k in obj for k in keys):
            return tool
    return None


def _from_object(obj: Any, where: str) -> MeasuredPoint:
    tool = tool_of(obj)
    if tool is None:
        got = "a JSON object" if isinstance(obj, dict) else "not a JSON object"
        raise InputError(f"{where}: {got} without the fields of a vllm bench serve --save-result file "
                         "(total_token_throughput, endpoint_type), an sglang bench_serving --output-file line "
                         "(total_throughput, random_input_len) or an AIPerf export (aiperf_version, "
                         "output_token_throughput)")
    f = _Fields(obj, where, tool)
    if tool == AIPERF:
        return _aiperf_point(f)
    return _point(f, "total_token_throughput" if tool == VLLM else "total_throughput",
                  "spec_decode_acceptance_length" if tool == VLLM else "accept_length")


def read_results(path: str | Path) -> list[MeasuredPoint]:
    """The runs of one result file: a JSON object (vLLM ``--save-result``, an AIPerf export) or JSON lines
    (SGLang ``--output-file``, vLLM ``--append-result``), one run per line."""
    p = Path(path)
    try:
        data = read_bytes(p, "result file")
    except FileNotFoundError:
        raise InputError(f"{p}: no such file") from None
    if not data.strip():
        raise InputError(f"{p}: empty, expected a benchmark result file")
    try:
        return [_from_object(parse_json(data, str(p)), str(p))]
    except InputError as whole:
        first = data.lstrip().split(b"\n", 1)[0]
        try:  # JSON lines, when the first line is a JSON value of its own
            parse_json(first, str(p))
        except InputError:
            raise whole from None
        if first.strip() == data.strip():
            raise whole from None
    out = []
    for lineno, line in json_lines(p, "result file"):
        out.append(_from_object(parse_json(line, _where(p, lineno), "a JSON object per line"), _where(p, lineno)))
    return out
