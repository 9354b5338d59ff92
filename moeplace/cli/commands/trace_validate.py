"""``place trace validate PATH...``: the trace gate every command reads traces through
(:mod:`traces.validate`), with every problem listed; one line per problem."""

from __future__ import annotations

import json
import sys

from moeplace.cli import flags
from moeplace.cli.commands import add_json
from moeplace.foundation.formats import tagged
from moeplace.traces.validate import DEFAULT_MAX_PER_KIND, validate_report

GROUP = "trace"


def register(sub) -> None:
    p = sub.add_parser(
        "validate",
        help="check traces (files or directories) against the trace format",
        description="Streams every Parquet file through the checks every command applies to the traces "
        "it reads and reports the problems as one line each, naming file, row (or row group) and "
        "field; the first line is the error any other command stops at on this trace. Exit code 2 "
        "when any problem is found, 0 with a one-line OK summary otherwise.",
    )
    p.add_argument("paths", nargs="+", metavar="PATH", help="trace file or directory")
    p.add_argument(
        "--max-per-kind",
        type=flags.int_range(),
        default=DEFAULT_MAX_PER_KIND,
        help="problems listed per kind before only counting them (default "
        f"{DEFAULT_MAX_PER_KIND}; 0 or less lists only the first problem). Changes the listing, never the "
        "verdict",
    )
    add_json(p, "per trace: ok, files, rows, tokens, model and the problems listed (the exit code is the same)")
    p.set_defaults(func=run)


def run(args) -> int:
    bad = False
    docs = []
    for path in args.paths:
        report = validate_report(path, max_per_kind=args.max_per_kind)
        docs.append(report_doc(path, report))
        if report.ok:
            if not args.json:
                print(f"{path}: {report.summary()}")
            continue
        bad = True
        for line in report.lines():
            print("place: error: " + " ".join(line.split("\n")), file=sys.stderr)  # one line per problem
    if args.json:
        doc = {"ok": not bad, "traces": docs}
        if bad:  # the error contract of every command's --json: the first problem, the exit code
            first = next((d["problems"][0]["line"] for d in docs if not d["ok"] and d["problems"]),
                         "the trace is not valid")
            doc.update(error=" ".join(first.split("\n")), exit_code=2)
        print(json.dumps(tagged("trace-validation", doc), indent=1))
    return 2 if bad else 0


def report_doc(path: str, report) -> dict:
    """One trace's verdict for ``--json``: the figures of the OK line, or the problems listed (the first is
    the error every other command stops at) and how many more of each kind were found."""
    m = report.model
    return {"path": str(path), "ok": report.ok, "files": report.num_files, "rows": report.num_rows,
            "tokens": report.num_tokens,
            "model": None if m is None else {"name": m.name, "moe_layers": m.num_moe_layers,
                                             "experts": m.num_experts, "top_k": m.top_k},
            "problems_found": report.total,
            "problems": [{"kind": p.kind, "path": p.path, "row": p.row, "field": p.field, "message": p.message,
                          "line": str(p)} for p in report.problems],
            "not_listed": dict(sorted(report.suppressed.items()))}
