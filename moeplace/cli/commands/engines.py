"""``place engines [--model M ...] [--engine E ...] [--json]``: the capability table — which released
serving engine applies a placement to which model, and how (relabelled checkpoint, load-time plugin,
placement file, online EPLB, statistics dump), each cell with its reason. The same table every other
command reads (``placement/export/capabilities.py``)."""
from __future__ import annotations

import json

from moeplace.cli.commands import add_json
from moeplace.foundation.formats import tagged
from moeplace.foundation.model import load_model, preset_names
from moeplace.placement.export import capabilities


def register(sub) -> None:
    p = sub.add_parser("engines", help="which engine applies a placement to which model, and how (capability table)",
                       description=__doc__)
    p.add_argument("--model", action="append", default=None,
                   help=f"model preset or config.json (repeatable; default the presets: {', '.join(preset_names())})")
    p.add_argument("--engine", action="append", choices=list(capabilities.ENGINES), default=None,
                   help="engine (repeatable; default all)")
    p.add_argument("--reasons", action="store_true", help="print every cell's reason, not only the unsupported ones")
    add_json(p, "the features, the engine releases and every cell with its reason")
    p.set_defaults(func=run)


def _grid(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def run(args) -> int:
    models = [load_model(m) for m in (args.model or preset_names())]
    engines = args.engine or list(capabilities.ENGINES)
    if args.json:
        print(json.dumps(tagged("engine-capabilities", capabilities.to_json(models, engines)), indent=1))
        return 0
    feats = list(capabilities.FEATURES.values())
    print("what each engine release does with a moeplace placement (yes / no / ? = not checked); "
          "place engines --json has every reason")
    for name in engines:
        e = capabilities.ENGINES[name]
        rows = [["model (architecture)", *[f.title for f in feats]]]
        notes = []
        for m in models:
            cells = [e.cell(m, f.name) for f in feats]
            rows.append([f"{m.name} ({m.hf_model_type or '?'})", *[c.mark for c in cells]])
            for c in cells:
                if args.reasons or c.supported is not True:
                    notes.append(f"  {m.name}, {capabilities.FEATURES[c.feature].title}: {c.reason}")
        print(f"\n{e.title} {e.version}")
        for line in _grid(rows):
            print("  " + line)
        for line in dict.fromkeys(notes):
            print(line)
    print(f"\nload-time plugin: {capabilities.PLUGIN_INSTALL}, then {capabilities.PLUGIN_ENV}=PLACEMENT.json vllm "
          "serve ... (entry point vllm.general_plugins: moeplace); relabelled checkpoint: place export PLACEMENT "
          "--format checkpoint --model-path SRC --out DST. Both need a placement without replicas "
          "(place optimize ... --redundant 0).")
    return 0
