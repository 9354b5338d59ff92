"""Chrome trace-event JSON (viewable in Perfetto or chrome://tracing): engine iterations with their
batch, the layer-by-layer breakdown of each iteration, and request lifecycles. Times in microseconds."""
from __future__ import annotations

import math

US = 1e6
LAYER_ITERATIONS = 50  # iterations that also get a per-layer breakdown (keeps the file small)


def iteration_events(pool, now: float, dt: float, st, work, stall: float, model, layers: bool = True) -> list[dict]:
    """One complete ("X") event per iteration on the pool's thread, plus one per decoder layer on the
    pool's layer thread (MoE layers name their straggler time)."""
    tid = {"main": 1, "prefill": 1, "decode": 3}.get(pool.name, 1)
    out = [{"name": f"iteration {pool.iteration}", "cat": "iteration", "ph": "X", "ts": now * US, "dur": dt * US,
            "tid": tid, "args": {"decode_seqs": int(work.dec_seqs.sum()), "prefill_tokens": int(work.pre_tokens.sum()),
                                 "straggler_ms": float(st.straggler.sum()) * 1e3, "stall_ms": stall * 1e3}}]
    if not layers:
        return out
    t = now + stall
    moe_idx = {layer: j for j, layer in enumerate(model.moe_layers)}
    for i, d in enumerate(st.layer):
        j = moe_idx.get(i)
        args = {"attention": model.attention[i]}
        if j is not None:
            args["straggler_us"] = float(st.straggler[j]) * US
        out.append({"name": f"layer {i}", "cat": "layer", "ph": "X", "ts": t * US, "dur": float(d) * US,
                    "tid": tid + 1, "args": args})
        t += float(d)
    return out


def request_events(requests, duration: float) -> list[dict]:
    """Async spans per request: queued (arrival -> admission), prefill (admission -> first token),
    decode (first token -> finish)."""
    out = []
    for q in requests:
        end = q.finished if not math.isnan(q.finished) else duration
        phases = [("queued", q.arrival, q.admitted), ("prefill", q.admitted, q.first_token),
                  ("decode", q.first_token, end)]
        for name, a, b in phases:
            if math.isnan(a) or math.isnan(b) or b < a:
                continue
            common = {"cat": "request", "id": q.id, "tid": 10, "name": name}
            out.append({**common, "ph": "b", "ts": a * US, "args": {"request": q.id, "prompt": q.prompt_len,
                                                                   "output": q.output_len}})
            out.append({**common, "ph": "e", "ts": b * US})
    return out
