"""The comparison as people read it: the table ``place optimize`` prints, the shift-estimate lines and the
notes on what the time limit cut."""
from __future__ import annotations

from moeplace.placement.compare import Comparison, duplicate_layers
from moeplace.placement.evaluate import Metrics
from moeplace.placement.windows import window_span


def _traffic_cells(m: Metrics) -> tuple[str, str]:
    """nodes/tok and remote-node KiB/tok cells; ``~`` marks the independence estimate (no token sample)."""
    est = "~" if not m.traffic_method.startswith(("token sample", "exact")) else ""
    return f"{est}{m.remote_per_token['node']:.3f}", f"{est}{m.dispatch_bytes_per_token['node'] / 1024:.0f}"


def format_table(cmp: Comparison) -> str:
    """The text table ``place optimize`` prints."""
    has_held = cmp.held_windows.size > 0
    if has_held:
        head = ["policy", "time s", "plan bal", "held bal", "held worst", "held max/mean", "held nodes/tok",
                "held KiB/tok", "dup GPUs"]
    else:
        head = ["policy", "time s", "plan bal", "shift mean", "shift worst", "plan nodes/tok", "plan KiB/tok",
                "dup GPUs"]
    rows = []
    for label, r in [(r.policy, r) for r in cmp.results] + [(label, r) for label, r, _ in cmp.replica_rows]:
        p, h = r.planning, r.held_out
        dup = str(duplicate_layers(r.placement, p))
        if has_held:
            rows.append([label, f"{r.seconds:.2f}", f"{p.balancedness:.4f}", f"{h.balancedness:.4f}",
                         f"{h.worst_window_balancedness:.4f}", f"{h.max_over_mean:.4f}", *_traffic_cells(h), dup])
        else:
            sm = f"{r.shift['mean']:.4f}" if r.shift else "-"
            sw = f"{r.shift['worst']:.4f}" if r.shift else "-"
            rows.append([label, f"{r.seconds:.2f}", f"{p.balancedness:.4f}", sm, sw, *_traffic_cells(p), dup])
    widths = [max(len(x[i]) for x in [head] + rows) for i in range(len(head))]
    fmt = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                  for i, (c, w) in enumerate(zip(cells, widths)))
    c = cmp.cluster
    span = (f"plan windows {window_span(cmp.planning_windows)}, held-out windows {window_span(cmp.held_windows)}" if has_held
            else f"planned on every window ({window_span(cmp.planning_windows)}), nothing held out")
    layers = (f"; scored on {cmp.scored_layers} of {cmp.moe_layers} MoE layers (the others have no tokens)"
              if cmp.scored_layers < cmp.moe_layers else "")
    tokens = f"{cmp.tokens:,} tokens in {cmp.planning_windows.size + cmp.held_windows.size} windows; " if cmp.tokens else ""
    held = (f"{cmp.layers_label} (the MoE layers the input holds; every figure is over those only); "
            if cmp.layers_label else "")
    lines = [(f"engine {cmp.rule}, {c.name} ({c.num_gpus} GPUs), {cmp.num_redundant} redundant slots; "
              f"{held}{tokens}{span}{layers}"), fmt(head), fmt(["-" * w for w in widths])]
    lines += [fmt(r) for r in rows]
    sampled = (f"{cmp.held_sample_tokens} sampled held-out tokens" if has_held
               else f"{cmp.planning_sample_tokens} sampled planning tokens (in-sample)")
    lines.append("bal = mean/max tokens per GPU per layer, averaged over layers with tokens (SGLang form); "
                 "worst = lowest window; nodes/tok = other nodes a token is sent to per MoE layer and "
                 "KiB/tok = the bytes those sends carry per token over all MoE layers (one send per remote "
                 f"node, DeepEP-style), replayed on {sampled}"
                 "; ~ = estimate (no token sample: k selections taken as independent draws); dup GPUs = "
                 "layers with two replicas of one expert on one GPU")
    lines += [f"note: {n}" for n in cmp.notes]
    return "\n".join(lines)


def _rng(r: dict, signed: bool = False) -> str:
    f = "+.3f" if signed else ".3f"
    return "(no range)" if r.get("range") is None else f"[{r['range'][0]:{f}}, {r['range'][1]:{f}}]"


def format_shift(cmp: Comparison, chosen: str | None = None) -> list[str]:
    """Lines under the table: per kind of new workload the inputs say (a tag's values left out in turn,
    else the grouping found), each policy's balancedness to expect on one such workload with its 80 %
    prediction interval, the written policy's paired difference to each other policy, and what would
    narrow each range too wide to plan with (every policy's, the written one's first; said once where
    they agree). ``chosen``: the policy written (default moeplace, else the first)."""
    rows = [r for r in cmp.results if r.shift]
    if not rows:
        return []
    names = [r.policy for r in rows]
    chosen = chosen if chosen in names else ("moeplace" if "moeplace" in names else names[0])
    out = [(f"shift estimate — balancedness to expect on one new workload unlike the planning data; each range "
           f"an {rows[0].shift.get('coverage', 0.8):.0%} prediction interval for one such workload, from leaving "
           "out each group of the planning inputs in turn and planning on the rest with the written placement's "
           f"settings (cost: {cmp.shift_cost}):")]
    for g in cmp.shift_groupings:
        key = g["key"]
        first = rows[0].shift["by_tag"].get(key)
        if first is None:
            continue
        out.append(f"  {g['what']} ({g['how']}: {', '.join(g['groups'])}; range: {first['interval']}):")
        for r in rows:
            t = r.shift["by_tag"][key]
            se = t.get("layer_sample_se") or 0.0
            err = f", ± {se:.4f} from the layer sample" if se else ""
            out.append(f"    {r.policy}: {t['mean']:.4f} {_rng(t)} (lowest left out {t['worst']:.4f}{err})")
        mine = next(r for r in rows if r.policy == chosen).shift
        for other in names:
            d = (mine.get("versus", {}).get(other) or {}).get(key)
            if d is None:
                continue
            verdict = {"ahead": f"{chosen} ahead", "behind": f"{other} ahead"}.get(d["verdict"], d["verdict"])
            out.append(f"    {chosen} - {other}: {d['mean']:+.4f} {_rng(d, signed=True)} (paired over the same "
                       f"left-out groups): {verdict}")
        said = set()  # what would narrow each policy's range, the written one first (once where they agree)
        for r in sorted(rows, key=lambda r: r.policy != chosen):
            msg = r.shift["by_tag"][key].get("narrower")
            if msg and msg not in said:
                out.append(f"    {r.policy}: {msg}")
                said.add(msg)
    return out
