"""Saved vLLM responses with routed experts (``vllm serve --enable-return-routed-experts``) -> a trace.

Read in vLLM's source (github vllm-project/vllm, stored copies of 2026):

- ``vllm/model_executor/layers/fused_moe/routed_experts_capturer.py``: ``RoutedExpertsCapturer`` keeps
  ``[tokens, num_hidden_layers, num_experts_per_tok]`` (``hf_text_config`` sizes; a MoE layer writes row
  ``layer_id``, dense rows stay 0) and ``RoutedExpertsReader.get_routed_experts`` returns the rows of one
  request's KV slots.
- ``vllm/entrypoints/openai/chat_completion/protocol.py`` (``ChatCompletionResponseChoice``, main): the
  choice's ``routed_experts`` is a string: base64 of ``np.save`` bytes (decode with
  ``np.load(io.BytesIO(base64.b64decode(s)))``), shape ``(num_tokens - 1, num_layers, num_experts_per_tok)``
  over prompt *and* generated tokens (the last sampled token was never forwarded), dtype uint8/uint16/int32.
  ``prompt_token_ids`` / ``token_ids`` carry the token ids when requested.
- vLLM 0.34 (``vllm/sampling_params.py``, ``vllm/distributed/aux_output_connector/worker.py``): the request
  field ``routed_experts_prompt_start`` (default 0, at most the prompt length) makes the server skip that
  many prompt tokens: the worker's emit cursor starts there, so the array holds the rows of tokens
  ``start .. prompt + generated - 2``, ``prompt + generated - 1 - start`` rows. The response does not echo the
  field; a collector that sets it saves it on the record (top-level ``routed_experts_prompt_start``, as the
  collector in docs/traces.md does). The row count is checked against that invariant whenever the generated
  length is known (``token_ids``, or ``usage.completion_tokens`` with one choice) and a mismatch is refused,
  never relabelled: rows short by ``s`` tokens are what a start of ``s`` gives, and the error says so.
- Earlier releases put the generated tokens' routing on the choice as nested lists ``[tokens, layers, k]``
  and the prompt's on the response as ``prompt_routed_experts`` (seen in responses saved from vLLM 0.21,
  ``system_fingerprint`` ``vllm-0.21.0-...``; that protocol version is not among the stored source copies).
  Some clients store the array as ``{"encoding": "base64", "dtype": "int16", "shape": [...], "data": ...}``
  (raw little-endian buffer). All three forms are read.

Input: JSON files holding one response object, a list of them, or JSONL with one response per line (the
collector in docs/traces.md writes JSONL). A response is a chat completion or completion (``choices``).

Trace: one request per (response, choice) in file order; ``position`` is the token index in the sequence
(prompt first), ``phase`` prefill for prompt tokens and decode for generated ones, ``step`` the order of
tokens as listed (requests one after another), ``token_id`` when every response carries its ids. The prompt
length comes from ``prompt_token_ids`` or ``usage.prompt_tokens``; with ``n > 1`` the prompt rows are taken
from the first choice only. The layer axis may hold every decoder layer (dense rows dropped) or the MoE
layers only. Errors name the file, the response (line) and the field.
"""

from __future__ import annotations

import base64
import binascii
import io
import time
from pathlib import Path

import numpy as np

from moeplace.foundation import reading
from moeplace.foundation.errors import InputError
from moeplace.foundation.model import ModelSpec
from moeplace.traces.importers import ImportResult
from moeplace.traces.importers._common import (
    expert_id_matrix,
    jsonl_records,
    moe_layer_axis,
    write_validated_trace,
)
from moeplace.traces.phases import PHASES_KNOWN

_INT_DTYPES = {"int8", "uint8", "int16", "uint16", "int32", "uint32", "int64"}


def _responses(path: Path):
    """``(where, response dict)`` for every response in a .json (object or list) or .jsonl file."""
    if path.suffix == ".jsonl":
        for lineno, obj in jsonl_records(path):
            yield f"line {lineno}", obj
        return
    data = reading.read_json(path)
    items = data if isinstance(data, list) else [data]
    for i, obj in enumerate(items):
        if not isinstance(obj, dict):
            raise InputError(f"{path}: response {i}: expected a JSON object, got {type(obj).__name__}")
        yield (f"response {i}" if isinstance(data, list) else "response"), obj


def _decode(value, path: Path, where: str, field: str) -> np.ndarray:
    """One ``routed_experts`` value (base64 .npy string, nested lists, or base64 raw-buffer dict)."""
    prefix = f"{path}: {where}: field '{field}'"
    if isinstance(value, str):
        try:
            raw = base64.b64decode(value, validate=True)
            if not raw.startswith(b"\x93NUMPY"):
                raise ValueError("no .npy header")
            arr = np.load(io.BytesIO(raw), allow_pickle=False)
        except (binascii.Error, ValueError, OSError, EOFError) as exc:
            raise InputError(f"{prefix}: not base64 of a .npy array ({exc})") from None
    elif isinstance(value, dict):
        dtype, shape, data = value.get("dtype"), value.get("shape"), value.get("data")
        if value.get("encoding", "base64") != "base64" or dtype not in _INT_DTYPES or not isinstance(data, str):
            raise InputError(f"{prefix}: expected {{'encoding': 'base64', 'dtype': <integer dtype>, 'shape': [...], "
                             "'data': ...}")
        if not (isinstance(shape, list) and len(shape) == 3
                and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in shape)):
            raise InputError(f"{prefix}: field 'shape' must be [tokens, layers, top_k], got {shape!r}")
        try:
            buf = base64.b64decode(data, validate=True)
            arr = np.frombuffer(buf, dtype=np.dtype(dtype).newbyteorder("<")).reshape(shape)
        except (binascii.Error, ValueError) as exc:
            raise InputError(f"{prefix}: data does not decode to {dtype} {shape} ({exc})") from None
    elif isinstance(value, list):
        try:
            arr = np.asarray(value)
        except ValueError:
            arr = np.asarray([0.5])  # ragged: reported below
        if arr.size == 0:
            return np.zeros((0, 0, 0), dtype=np.int64)
        if arr.dtype == object or arr.dtype.kind not in "iu":
            raise InputError(f"{prefix}: expected a [tokens][layers][top_k] list of integer expert ids")
    else:
        raise InputError(f"{prefix}: expected a base64 string, a nested list or a base64 dict, got "
                         f"{type(value).__name__}")
    if arr.ndim != 3:
        raise InputError(f"{prefix}: {arr.ndim}-D array of shape {list(arr.shape)}, expected [tokens, layers, top_k]")
    if arr.dtype.kind not in "iu":
        raise InputError(f"{prefix}: dtype {arr.dtype}, expected integer expert ids")
    return arr


def _int_list(value, path: Path, where: str, field: str) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, list) or any(isinstance(x, bool) or not isinstance(x, int) for x in value):
        raise InputError(f"{path}: {where}: field '{field}' must be a list of integer token ids")
    return value


def _tokens(arr: np.ndarray, model: ModelSpec, path: Path, where: str, field: str) -> np.ndarray:
    """``[tokens, layers, k]`` -> ``[tokens, MoE layers, k]`` uint16, ids checked."""
    if arr.shape[0] == 0:
        return np.zeros((0, model.num_moe_layers, model.top_k), dtype=np.uint16)
    arr = moe_layer_axis(arr, model, path, where, field)
    n, L = arr.shape[:2]
    ids = expert_id_matrix(arr.reshape(n * L, arr.shape[2]), path, where, field, model.num_experts, model.top_k,
                           lambda r: f"token {r // L} (layer {model.moe_layers[r % L]})")
    return ids.reshape(n, L, model.top_k)


def _prompt(resp: dict, path: Path, where: str, model: ModelSpec) -> tuple[list | None, int, np.ndarray | None, int]:
    """A response's prompt: its token ids (or None), its length (from the ids, ``usage.prompt_tokens`` or
    the prompt's routing), its routing ``[n, L, k]`` when the response carries it apart (0.21 form) and the
    ``routed_experts_prompt_start`` the request set (0 when the record does not say)."""
    prompt_ids = _int_list(resp.get("prompt_token_ids"), path, where, "prompt_token_ids")
    usage = resp.get("usage") if isinstance(resp.get("usage"), dict) else {}
    n_prompt = len(prompt_ids) if prompt_ids is not None else usage.get("prompt_tokens")
    prompt_re = resp.get("prompt_routed_experts")
    prompt_arr = None
    if prompt_re is not None:
        prompt_arr = _tokens(_decode(prompt_re, path, where, "prompt_routed_experts"), model, path, where,
                             "prompt_routed_experts")
        if n_prompt is None:
            n_prompt = prompt_arr.shape[0]
    if isinstance(n_prompt, bool) or not isinstance(n_prompt, int) or n_prompt < 0:
        raise InputError(f"{path}: {where}: the prompt length is unknown (fields 'prompt_token_ids', "
                         "'usage.prompt_tokens' and 'prompt_routed_experts' missing); it places the routed "
                         "tokens in the sequence")
    if prompt_arr is not None and prompt_arr.shape[0] != n_prompt:
        raise InputError(f"{path}: {where}: field 'prompt_routed_experts' has {prompt_arr.shape[0]} tokens, "
                         f"the prompt {n_prompt}")
    start = resp.get("routed_experts_prompt_start", 0)
    if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= n_prompt:
        raise InputError(f"{path}: {where}: field 'routed_experts_prompt_start' is {start!r}, expected an integer "
                         f"from 0 to the prompt length {n_prompt} (vLLM's own bounds)")
    if start and prompt_arr is not None:
        raise InputError(f"{path}: {where}: field 'routed_experts_prompt_start' is set on a response in the "
                         "vLLM 0.21 form (prompt_routed_experts), which has no such field")
    return prompt_ids, n_prompt, prompt_arr, start


def _generated(choice: dict, gen_ids: list | None, resp: dict, n_choices: int) -> int | None:
    """How many tokens a choice generated: its ``token_ids``, or ``usage.completion_tokens`` when the
    response has one choice (the usage sums over choices); None when neither says."""
    if gen_ids is not None:
        return len(gen_ids)
    usage = resp.get("usage") if isinstance(resp.get("usage"), dict) else {}
    n = usage.get("completion_tokens")
    if n_choices == 1 and isinstance(n, int) and not isinstance(n, bool) and n >= 0:
        return n
    return None


def _choice_tokens(choice, c: int, prompt: tuple, path: Path, where: str, model: ModelSpec,
                   resp: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """Choice ``c``'s routed tokens: positions, phases, ids ``[n, L, k]`` and token ids (or None). The
    prompt's rows come with the first choice only."""
    prompt_ids, n_prompt, prompt_arr, start = prompt
    cw = f"{where}: choice {c}"
    if not isinstance(choice, dict):
        raise InputError(f"{path}: {cw}: expected a JSON object")
    value = choice.get("routed_experts")
    if value is None:
        raise InputError(f"{path}: {cw}: field 'routed_experts' is null (the server needs "
                         "--enable-return-routed-experts)")
    arr = _tokens(_decode(value, path, cw, "routed_experts"), model, path, cw, "routed_experts")
    gen_ids = _int_list(choice.get("token_ids"), path, cw, "token_ids")
    if isinstance(value, str):  # main: tokens start .. prompt + generated - 2 in one array
        n_rows = arr.shape[0]
        n_gen = _generated(choice, gen_ids, resp, len(resp["choices"]))
        skip = f" - routed_experts_prompt_start {start}" if start else ""
        if n_gen is not None and n_rows != max(n_prompt + n_gen - 1 - start, 0):
            want = max(n_prompt + n_gen - 1 - start, 0)
            hint = ""
            if start == 0 and 0 < want - n_rows <= n_prompt:
                hint = (f"; {want - n_rows} rows short is what a request with routed_experts_prompt_start="
                        f"{want - n_rows} returns: save that request field on the record")
            raise InputError(f"{path}: {cw}: field 'routed_experts' has {n_rows} rows, vLLM returns prompt "
                             f"{n_prompt} + generated {n_gen} - 1{skip} = {want}; refusing rather than "
                             f"mislabelling tokens{hint}")
        if n_rows < n_prompt - start:
            raise InputError(f"{path}: {cw}: field 'routed_experts' has {n_rows} rows, fewer than the "
                             f"{n_prompt - start} prompt tokens it covers (prompt {n_prompt}{skip})")
        pos = np.arange(start, start + n_rows, dtype=np.int32)
        keep = slice(None) if c == 0 else slice(n_prompt - start, None)
    else:  # 0.21: generated tokens here, the prompt's in prompt_routed_experts
        pos = np.arange(n_prompt, n_prompt + arr.shape[0], dtype=np.int32)
        if c == 0 and prompt_arr is not None:
            arr = np.concatenate([prompt_arr, arr])
            pos = np.concatenate([np.arange(n_prompt, dtype=np.int32), pos])
        keep = slice(None)
    arr, pos = arr[keep], pos[keep]
    phase = (pos >= n_prompt).astype(np.uint8)
    tok = None
    if prompt_ids is not None and gen_ids is not None:
        full = np.asarray(prompt_ids + gen_ids, dtype=np.int64)
        if pos.size and pos[-1] >= full.size:
            raise InputError(f"{path}: {cw}: routed_experts covers {int(pos[-1]) + 1} tokens but "
                             f"prompt_token_ids + token_ids hold {full.size}")
        tok = full[pos]
        if tok.size and (tok.min() < 0 or tok.max() > np.iinfo(np.int32).max):
            raise InputError(f"{path}: {cw}: a token id is outside int32")
    return pos, phase, arr, tok


def import_(srcs: list[Path], model: ModelSpec, out: Path | None, **_: object) -> ImportResult:
    t0 = time.perf_counter()
    if out is None:
        raise InputError("vllm-routed-experts responses become a trace: give --out DIR")
    seqs = []  # (request index, positions, phases, ids [n, L, k], token ids or None)
    responses = 0
    request_ids: list[str] = []
    for path in srcs:
        for where, resp in _responses(path):
            responses += 1
            choices = resp.get("choices")
            if not isinstance(choices, list) or not choices:
                raise InputError(f"{path}: {where}: field 'choices' missing or empty (expected a vLLM completion "
                                 "response)")
            prompt = _prompt(resp, path, where, model)
            for c, choice in enumerate(choices):
                pos, phase, arr, tok = _choice_tokens(choice, c, prompt, path, where, model, resp)
                if arr.shape[0]:
                    seqs.append((len(request_ids), pos, phase, arr, tok))
                request_ids.append(f"{resp.get('id', where)}#{c}")
    if not seqs:
        raise InputError(f"{', '.join(map(str, srcs))}: no routed tokens in the responses")
    with_tokens = all(s[4] is not None for s in seqs)
    L = model.num_moe_layers
    layers = np.asarray(model.moe_layers, dtype=np.uint16)
    step0 = 0
    tokens = 0

    def write(w):
        nonlocal step0, tokens
        for rid, pos, phase, arr, tok in seqs:
            n = pos.size
            tokens += n
            w.write(request_id=np.full(n * L, rid, dtype=np.int64), position=np.repeat(pos, L),
                    phase=np.repeat(phase, L), step=np.repeat(np.arange(step0, step0 + n, dtype=np.int64), L),
                    layer=np.tile(layers, n), expert_ids=arr.reshape(n * L, model.top_k),
                    token_id=np.repeat(tok, L) if with_tokens else None)
            step0 += n

    prov = {"kind": "imported", "format": "vllm-routed-experts", "sources": [str(s) for s in srcs],
            "requests": request_ids, "step": "token order as listed (requests one after another)",
            "phase": "the array's prompt rows prefill (0), its generated rows decode (1)", PHASES_KNOWN: True}
    rows = write_validated_trace(out, model, prov, write, token_id=with_tokens)
    secs = time.perf_counter() - t0
    summary = {"format": "vllm-routed-experts", "records_read": responses, "requests": len(request_ids),
               "rows_written": rows, "tokens": tokens, "layers_covered": list(model.moe_layers),
               "seconds": secs, "records_per_s": responses / secs if secs > 0 else 0.0}
    return ImportResult("trace", trace=out, summary=summary)
