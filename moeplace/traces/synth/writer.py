"""Writing a synthetic trace: :func:`synthesize` streams the sampler's chunks to a trace directory,
optionally through a forked writer process that reads shared-memory buffers."""
from __future__ import annotations

import contextlib
import mmap
import multiprocessing as mp
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from moeplace.foundation.errors import InputError
from moeplace.foundation.files import clean_stale_temps, raise_on_sigterm
from moeplace.foundation.model import ModelSpec
from moeplace.foundation.progress import bar
from moeplace.traces import jit
from moeplace.traces.format import TraceWriter
from moeplace.traces.synth.calibration import build_design
from moeplace.traces.synth.config import SYNTH_VERSION, SynthConfig, check_resources
from moeplace.traces.synth.pipeline import RING_SLOTS, LayerPipeline
from moeplace.traces.synth.requests import chunk_tokens, synth_chunks


class _TraceSink:
    """Writes the token batches of :func:`synth_chunks` as trace rows (token-major: the L MoE-layer rows
    of a token are consecutive) through a :class:`TraceWriter`."""

    def __init__(self, model: ModelSpec, cfg: SynthConfig, domains: tuple[str, ...]) -> None:
        self.pa = pa
        self.cfg = cfg
        self.num_layers = model.num_moe_layers
        self.layers = np.asarray(model.moe_layers, np.uint16)
        self.names = pa.array(list(domains), pa.string())

    def write(self, writer: TraceWriter, b: dict[str, np.ndarray]) -> None:
        pa, num_layers = self.pa, self.num_layers
        n = len(b["request_id"])

        def rep(x: np.ndarray) -> np.ndarray:  # token-major rows: all layers of a token
            return np.repeat(x, num_layers)

        dom = pa.DictionaryArray.from_arrays(pa.array(rep(b["domain"]).astype(np.int8)), self.names)
        writer.write(request_id=rep(b["request_id"]), position=rep(b["position"]), phase=rep(b["phase"]),
                     step=rep(b["step"]), layer=np.tile(self.layers, n),
                     expert_ids=b["experts"].reshape(n * num_layers, -1),
                     gate_weights=(b["gate_weights"].reshape(n * num_layers, -1) if self.cfg.gate_weights
                                   else None),
                     token_id=rep(b["token_id"]), domain=dom.cast(pa.string()))


_ROW_KEYS = ("request_id", "position", "phase", "step", "domain", "token_id", "gate_weights")


class _WriterProcess:
    """The Parquet encoding and compression of a trace on a second core: a forked process owns the
    :class:`TraceWriter` (so the output stays atomic: it renames the finished directory, or deletes it
    when either side fails). Expert ids travel through a shared-memory ring of ``num_slots`` slots
    ``[max_tokens, L, k]`` (its own, one copy each; or ``ring``, the sampling pipeline's, no copy), the
    small per-token columns through a pipe; a slot is reused only after the writer acknowledged it, so at
    most ``num_slots`` batches are in flight."""

    num_slots = 2

    def __init__(self, out: Path, model: ModelSpec, cfg: SynthConfig, provenance: dict[str, Any],
                 sink: _TraceSink, max_tokens: int, ring: np.ndarray | None = None) -> None:
        self.out = out
        self.shm = None
        if ring is None:
            shape = (self.num_slots, max_tokens, model.num_moe_layers, model.top_k)
            self.shm = mmap.mmap(-1, int(np.prod(shape)) * 2)  # anonymous, shared with the fork
            ring = np.frombuffer(self.shm, np.uint16).reshape(shape)
        else:
            self.num_slots = ring.shape[0]
        self.ring = ring
        ctx = mp.get_context("fork")
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=self._serve, args=(child, out, model, cfg, provenance, sink),
                                daemon=True, name="moeplace-synth-writer")
        self.proc.start()
        child.close()
        self.busy = [False] * self.num_slots
        self.next_slot = 0
        self.written = 0  # batches acknowledged

    def _serve(self, conn, out, model, cfg, provenance, sink) -> None:
        """In the child: write every batch received, acknowledging its slot; exit on 'close'."""
        self.conn.close()  # the parent's end: the child must see EOF if the parent dies
        raise_on_sigterm()  # a SIGTERM sent to the child (or its process group) removes the temporary too
        try:
            with TraceWriter(out, model, provenance, gate_weights=cfg.gate_weights, token_id=True,
                             domain=True) as writer:
                while True:
                    msg = conn.recv()  # EOF: the parent aborted (or died) and closed its end
                    if msg[0] == "close":
                        break
                    _, slot, n, cols = msg
                    cols["experts"] = self.ring[slot, :n]
                    sink.write(writer, cols)
                    conn.send(("ack", slot))
            conn.send(("done", None))
        except EOFError:
            pass  # the temporary is gone already (TraceWriter's exit ran); nobody is left to tell
        except BaseException as exc:  # noqa: BLE001  (any failure goes to the parent, which raises it)
            try:
                conn.send(("error", exc))
            except OSError:
                pass  # the parent is gone
            except Exception:  # noqa: BLE001  (an exception that does not pickle)
                with contextlib.suppress(OSError):
                    conn.send(("error", RuntimeError(f"trace writer failed: {exc!r}")))
        finally:
            conn.close()

    def _recv(self) -> tuple[str, Any]:
        """One message from the writer; its error is raised here."""
        try:
            kind, val = self.conn.recv()
        except (EOFError, OSError):
            raise RuntimeError("the trace writer process died") from None
        if kind == "error":
            raise val
        return kind, val

    def _send(self, msg: tuple) -> None:
        try:
            self.conn.send(msg)
        except OSError:  # the writer is gone: raise its own error if it sent one
            while True:
                self._recv()

    def _wait(self) -> None:
        """Take one message from the writer: an acknowledged slot becomes free."""
        kind, val = self._recv()
        if kind == "ack":
            self.busy[val] = False
            self.written += 1

    def send(self, b: dict[str, np.ndarray]) -> None:
        slot = self.next_slot
        while self.busy[slot]:
            self._wait()
        ex = b["experts"]
        self.ring[slot, :len(ex)] = ex
        self.send_slot(slot, b)
        self.next_slot = (slot + 1) % self.num_slots

    def send_slot(self, slot: int, b: dict[str, np.ndarray]) -> None:
        """Write batch ``b`` whose experts lie in ring slot ``slot`` already (the pipeline's ring)."""
        self.busy[slot] = True
        self._send(("batch", slot, len(b["slot"]), {key: b[key] for key in _ROW_KEYS if key in b}))

    def close(self) -> None:
        """Wait until every batch is written and the directory is in place."""
        self._send(("close",))
        while self._recv()[0] != "done":
            pass
        self.proc.join()

    def abort(self) -> None:
        """Stop the writer and have it remove its temporary. The parent closes its end of the pipe rather
        than sending a message: a SIGTERM can interrupt :meth:`send` half-way through a batch, and a
        message appended to half a message would never be read, while EOF always is. A writer that does
        not finish in 30 s is killed and its temporary removed here."""
        self.conn.close()
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
            clean_stale_temps(self.out, report=False)

    def release(self) -> None:
        self.conn.close()
        del self.ring
        if self.shm is not None:
            self.shm.close()


def synth_workers(workers: int | None, cfg: SynthConfig, num_layers: int) -> int:
    """Sampling processes: ``workers`` if given, else one per usable core when the trace spans several
    chunks (a pipeline of one chunk has nothing to overlap); 1 where fork is missing or in a daemonic
    process (a multiprocessing.Pool worker may not have children)."""
    if workers is not None and workers < 1:
        raise InputError(f"--workers must be >= 1, got {workers}")
    if "fork" not in mp.get_all_start_methods() or mp.current_process().daemon:
        return 1
    if workers is None:
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # not on Linux
            cores = os.cpu_count() or 1
        workers = cores if cfg.num_tokens >= 2 * cfg.chunk_tokens else 1
    return max(1, min(workers, num_layers))


def synthesize(model: ModelSpec, cfg: SynthConfig, out: str | Path, writer_process: bool | None = None,
               workers: int | None = None) -> dict[str, Any]:
    """Write a synthetic trace directory ``out`` (atomically; rows token-major: the L MoE-layer rows of a
    token are consecutive, tokens in step order). Returns a summary: tokens, rows, selections,
    requests, seconds, bytes on disk, bytes per selection and the solved knobs.

    Every (chunk, MoE layer) draws from its own stream, so the trace is a function of the seed alone:
    ``workers`` sampling processes (:class:`~traces.synth.pipeline.LayerPipeline`, each a range of the
    layers; default one per core, :func:`synth_workers`) write the same bytes as one. The Parquet encoding
    and compression run in a forked writer process (``writer_process``; default: where fork exists), else
    on a thread; the files are the same either way."""

    check_resources(cfg, model.num_moe_layers, model.top_k, out)
    t0 = time.perf_counter()
    # the compiled loops (numba, when installed) load while the design is solved, for traces big enough to
    # pay numba's start-up; joined before any fork, so the sampling and writer processes inherit them
    big = cfg.num_tokens * model.num_moe_layers * model.top_k >= jit.MIN_SELECTIONS
    loader = jit.preload() if big else None
    with bar(None, "synth: solve the generator's parameters", "step") as pb:
        design = build_design(model, cfg)
        pb.update(1)
    if loader is not None:
        loader.join()
    t_plan = time.perf_counter() - t0
    provenance = {"kind": "synthetic", "generator": f"moeplace.synth/{SYNTH_VERSION}",
                  "config": asdict(cfg), "domains": list(design.domains), "solved": design.report}
    num_layers = model.num_moe_layers
    sink = _TraceSink(model, cfg, design.domains)
    num_tokens = 0
    requests: set[int] = set()
    if writer_process is None:  # a daemonic process (a multiprocessing.Pool worker) may not have children
        writer_process = "fork" in mp.get_all_start_methods() and not mp.current_process().daemon
    num_workers = synth_workers(workers, cfg, num_layers) if writer_process else 1
    # a chunk holds at least chunk_tokens and less than one more engine iteration
    max_tokens = min(cfg.num_tokens, cfg.chunk_tokens + cfg.max_batch_tokens)

    def count(b: dict[str, np.ndarray]) -> None:
        nonlocal num_tokens
        num_tokens += len(b["slot"])
        pb.update(len(b["slot"]))
        requests.update(np.unique(b["request_id"]).tolist())

    if writer_process:
        pipeline = LayerPipeline(design, num_workers, max_tokens, RING_SLOTS) if num_workers > 1 else None
        wp = None
        try:
            wp = _WriterProcess(Path(out), model, cfg, provenance, sink, max_tokens,
                                ring=None if pipeline is None else pipeline.experts)
            with bar(cfg.num_tokens, "synth", "tok") as pb:
                if pipeline is None:
                    for b in synth_chunks(design):
                        wp.send(b)
                        count(b)
                else:
                    _run_pipeline(design, pipeline, wp, count)
            wp.close()
        except BaseException:
            if wp is not None:
                wp.abort()
            raise
        finally:
            if pipeline is not None:
                pipeline.close()
            if wp is not None:
                wp.release()
    else:
        with TraceWriter(out, model, provenance, gate_weights=cfg.gate_weights, token_id=True,
                         domain=True) as writer, ThreadPoolExecutor(max_workers=1) as pool, \
                bar(cfg.num_tokens, "synth", "tok") as pb:
            pending = None
            for b in synth_chunks(design):
                if pending is not None:
                    pending.result()  # at most one batch in flight: memory stays at two batches
                pending = pool.submit(sink.write, writer, b)
                count(b)
            if pending is not None:
                pending.result()
    seconds = time.perf_counter() - t0
    disk = sum(f.stat().st_size for f in Path(out).rglob("*.parquet"))
    selections = num_tokens * num_layers * model.top_k
    return {"out": str(out), "tokens": num_tokens, "rows": num_tokens * num_layers, "selections": selections,
            "requests": len(requests), "seconds": seconds, "plan_seconds": t_plan,
            "selections_per_s": selections / seconds, "bytes": disk, "bytes_per_selection": disk / selections,
            "sample_workers": num_workers, "solved": design.report}


def _run_pipeline(design, pipeline: LayerPipeline, wp: _WriterProcess, count) -> None:
    """Chunks through the sampling pipeline into the writer, in order: chunk ``c`` uses ring slot
    ``c mod slots``, submitted once the slot's previous chunk is written; a drawn chunk goes to the
    writer at once."""
    slots = pipeline.num_slots
    pending: dict[int, dict[str, np.ndarray]] = {}
    submitted = drawn = 0

    def hand_over() -> None:  # the oldest chunk in the pipeline, drawn, to the writer
        nonlocal drawn
        c = pipeline.done()
        if c != drawn:
            raise RuntimeError(f"synth pipeline returned chunk {c}, expected {drawn}")
        b = pending.pop(c)
        wp.send_slot(c % slots, b)
        count(b)
        drawn += 1

    for b in chunk_tokens(design):
        while submitted - wp.written >= slots:  # the slot's chunk is not written yet
            if drawn < submitted:
                hand_over()
            else:
                wp._wait()
        pipeline.submit(submitted, submitted % slots, b)
        pending[submitted] = b
        submitted += 1
    while drawn < submitted:
        hand_over()
