"""``place trace validate PATH...``: check traces against the trace contract; one line per problem."""

from __future__ import annotations

import sys

from traces.validate import DEFAULT_MAX_PER_KIND, validate_report

GROUP = "trace"


def register(sub) -> None:
    p = sub.add_parser(
        "validate",
        help="check traces (files or directories) against the trace format",
        description="Streams every Parquet file and reports every problem (up to a limit per "
        "kind) as one line naming file, row (or row group) and field; exit code 2 "
        "when any is found, 0 with a one-line OK summary otherwise.",
    )
    p.add_argument("paths", nargs="+", metavar="PATH", help="trace file or directory")
    p.add_argument(
        "--max-per-kind",
        type=int,
        default=DEFAULT_MAX_PER_KIND,
        help=f"problems listed per kind before only counting them (default {DEFAULT_MAX_PER_KIND})",
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
            print(f"place: error: {line}", file=sys.stderr)
    return 2 if bad else 0
