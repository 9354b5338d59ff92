"""Sampling on several cores: a pipeline of forked workers, each drawing a contiguous range of the MoE
layers of every chunk of tokens (:class:`LayerPipeline`).

A layer's draws depend on the layer before (the inter-layer affinity source reads its experts) and on the
same layer of the chunk before (the locality source copies a request's previous token), and on nothing
else: worker ``w`` draws chunk ``c`` at its layers once worker ``w - 1`` has drawn chunk ``c`` at the
layers before, while that worker already draws chunk ``c + 1``. Every (chunk, layer) has its own random
stream (:func:`~traces.synth.requests.chunk_streams`), so the experts — and the trace's bytes — are the
same with any number of workers, one included (tested). The experts and the per-token inputs travel
through anonymous shared memory, a ring of ``num_slots`` chunks; the pipes carry only chunk numbers.
"""
from __future__ import annotations

import contextlib
import itertools
import mmap
import multiprocessing as mp
from multiprocessing.connection import wait

import numpy as np

from moeplace.foundation.files import raise_on_sigterm
from moeplace.traces.synth.requests import sample_chunk
from moeplace.traces.synth.sampler import ExpertSampler, SynthDesign

TOKEN_ARRAYS = (("domain", np.int64), ("rank", np.int64), ("prev", np.int64), ("slot", np.int64))
RING_SLOTS = 4  # chunks in flight: one per stage of a two-worker pipeline, one being written, one prepared


def layer_ranges(num_layers: int, workers: int) -> list[range]:
    """``workers`` contiguous ranges of the MoE layers, sizes differing by at most one."""
    cuts = [round(i * num_layers / workers) for i in range(workers + 1)]
    return [range(a, b) for a, b in itertools.pairwise(cuts) if b > a]


class LayerPipeline:
    """``workers`` forked sampling processes (see the module docstring). Use: :meth:`submit` a chunk into
    a free ring slot, :meth:`done` returns the next finished chunk; ``experts[slot]`` holds its experts
    ``[n, L, k]`` until the slot is submitted again. :meth:`close` stops the workers."""

    def __init__(self, design: SynthDesign, workers: int, max_tokens: int, num_slots: int) -> None:
        m, cfg = design.model, design.config
        self.ranges = layer_ranges(m.num_moe_layers, workers)
        self.num_slots, self.max_tokens = num_slots, max_tokens
        shape = (num_slots, max_tokens, m.num_moe_layers, m.top_k)
        ex_bytes = int(np.prod(shape)) * 2
        tok_bytes = num_slots * max_tokens * 8 * len(TOKEN_ARRAYS)
        self.shm = mmap.mmap(-1, ex_bytes + tok_bytes)  # anonymous, shared with the forks
        self.experts = np.frombuffer(self.shm, np.uint16, int(np.prod(shape))).reshape(shape)
        tok = np.frombuffer(self.shm, np.int64, num_slots * max_tokens * len(TOKEN_ARRAYS), ex_bytes)
        self.tokens = {name: a for (name, _), a in zip(TOKEN_ARRAYS, tok.reshape(len(TOKEN_ARRAYS), num_slots, max_tokens))}
        ctx = mp.get_context("fork")
        self.cmd, self.report, self.procs = [], [], []
        links = [ctx.Pipe(duplex=False) for _ in range(len(self.ranges) - 1)]  # w -> w + 1: chunk drawn
        for w, layers in enumerate(self.ranges):
            cmd_r, cmd_w = ctx.Pipe(duplex=False)
            rep_r, rep_w = ctx.Pipe(duplex=False)
            up = links[w - 1][0] if w > 0 else None
            down = links[w][1] if w + 1 < len(self.ranges) else None
            keep = {id(cmd_r), id(rep_w), id(up), id(down)}
            others = [c for c in (cmd_w, rep_r, *self.report, *(e for link in links for e in link)) if id(c) not in keep]
            p = ctx.Process(target=self._serve, args=(design, cfg.seed, layers, cmd_r, rep_w, up, down, others),
                            daemon=True, name=f"moeplace-synth-layers-{layers.start}-{layers.stop - 1}")
            p.start()
            cmd_r.close()
            rep_w.close()
            self.cmd.append(cmd_w)
            self.report.append(rep_r)
            self.procs.append(p)
        for r, w_ in links:
            r.close()
            w_.close()

    def _serve(self, design, seed, layers, cmd, report, up, down, others) -> None:
        """In a worker: draw ``layers`` of every chunk submitted, after the upstream worker drew its own."""
        for c in (*self.cmd, *others):
            c.close()  # the ends it does not use: it sees EOF when the parent (or its upstream) goes
        raise_on_sigterm()
        try:
            sampler = ExpertSampler(design, None, design.config.max_running, design.copy_prob, layers)
            while True:
                msg = cmd.recv()  # EOF: the parent closed the pipeline
                if msg is None:
                    break
                chunk, slot, n = msg
                if up is not None and up.recv() != chunk:  # the layers before are drawn
                    raise RuntimeError("synth pipeline out of order")
                b = {name: a[slot, :n] for name, a in self.tokens.items()}
                ex = self.experts[slot, :n]
                prev_layer = ex[:, layers.start - 1] if layers.start > 0 else None
                sample_chunk(sampler, seed, chunk, b, prev_layer, ex[:, layers.start:layers.stop])
                if down is not None:
                    down.send(chunk)
                report.send(("done", chunk))
        except (EOFError, BrokenPipeError):
            pass  # the parent is gone or closed the pipeline: nothing to report
        except BaseException as exc:  # noqa: BLE001  (any failure goes to the parent, which raises it)
            with contextlib.suppress(OSError):
                try:
                    report.send(("error", exc))
                except Exception:  # noqa: BLE001  (an exception that does not pickle)
                    report.send(("error", RuntimeError(f"synth sampling failed: {exc!r}")))
        finally:
            report.close()

    def submit(self, chunk: int, slot: int, b: dict[str, np.ndarray]) -> None:
        """Draw chunk ``chunk`` (tokens ``b``) into ring slot ``slot`` (free: its last chunk was written)."""
        n = len(b["slot"])
        for name, a in self.tokens.items():
            a[slot, :n] = b[name]
        for c in self.cmd:
            c.send((chunk, slot, n))

    def done(self) -> int:
        """The next chunk every worker has drawn (in submission order); a worker's error is raised here."""
        pending = set(range(len(self.report)))
        finished: int | None = None
        while pending:
            for conn in wait([self.report[i] for i in pending]):
                i = self.report.index(conn)
                try:
                    kind, val = conn.recv()
                except EOFError:
                    raise RuntimeError("a synth sampling process died") from None
                if kind == "error":
                    raise val
                if i == len(self.report) - 1:
                    finished = val
                pending.discard(i)
        assert finished is not None
        return finished

    def close(self) -> None:
        """Stop the workers (they finish the chunk at hand) and free the shared memory."""
        for c in self.cmd:
            with contextlib.suppress(OSError):
                c.close()
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
        for r in self.report:
            r.close()
        del self.experts, self.tokens
        with contextlib.suppress(BufferError):
            self.shm.close()
