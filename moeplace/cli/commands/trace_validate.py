"""``place trace validate PATH...``: the trace gate every command reads traces through
(:mod:`traces.validate`), with every problem listed; one line per problem."""

from __future__ import annotations

import sys

from moeplace.cli import flags
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
    p.set_defaults(func=run)


def run(args) -> int:
    bad = False
    for path in args.paths:
        report = validate_report(path, max_per_kind=args.max_per_kind)
        if report.ok:
            print(f"{path}: {report.summary()}")
            continue
        bad = True
        for line in report.lines():
            print("place: error: " + " ".join(line.split("\n")), file=sys.stderr)  # one line per problem
    return 2 if bad else 0
