"""Resolver check: can pip install moeplace (with its torch extra) beside the serving engines' releases?

    python bench/resolve_engines.py [--extra capture] [--engine sglang==0.5.23 --engine vllm==0.34.0]
                                    [--only-binary] [--out bench/results/resolve_engines.json]

For each engine pin, in a scratch virtual environment (so nothing installed anywhere counts), runs

    pip install --dry-run --ignore-installed --report - '<repo>[capture]' <engine pin>

which asks pip's resolver for one consistent set of distributions and downloads only metadata (PEP 658)
where the index serves it. When that fails only because a pin of the engine's is missing from the index
(the engine alone fails the same way), moeplace is resolved with all the engine's other direct
requirements instead, torch pin included, and the result says what was left out. Prints one line per
engine (the torch version pip chose, the seconds taken) and writes the JSON. Exit 0 when no engine
conflicts with moeplace, 1 otherwise. Needs the network
(PyPI); pip's own configuration (indexes, global constraints) applies as for any install on this machine.
``--only-binary`` adds ``--only-binary=:all:`` (never builds an sdist for its metadata).
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
import venv
from pathlib import Path

from _timing import ROOT, write_result

ENGINES = ["sglang==0.5.23", "vllm==0.34.0"]  # the releases the project checked (moeplace.placement.export)


def _pip(python: str, args: list[str], timeout: float) -> tuple[int, str, str, float]:
    cmd = [python, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--report", "-",
           "--disable-pip-version-check", *args]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return 124, "", f"pip did not finish in {timeout:.0f} s", time.perf_counter() - t0
    return p.returncode, p.stdout, p.stderr, time.perf_counter() - t0


def _errors(stderr: str) -> list[str]:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip() and not ln.startswith("WARNING")]
    keep = [ln for ln in lines if "ResolutionImpossible" in ln or "conflict" in ln.lower()
            or "requires" in ln or "No matching distribution" in ln or "depends on" in ln]
    return [ln[:300] for ln in (keep or lines or ["pip failed without a message"])[-6:]]


def _missing(stderr: str) -> list[str]:
    """Requirements pip found no distribution for at all (absent from the index), e.g. 'flashinfer-python==0.7.3'."""
    return re.findall(r"No matching distribution found for (\S+)", stderr)


def _chosen(stdout: str) -> dict[str, str]:
    report = json.loads(stdout)
    return {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in report.get("install", [])}


def resolve(python: str, project: Path, extra: str, engine: str, only_binary: bool, timeout: float) -> dict:
    """One dry-run resolve of ``project[extra]`` with ``engine``; returns what pip chose or why it failed.

    ``status``: ``resolved``; ``conflict`` (pip's resolver refuses the pair); or ``index-incomplete``: the
    engine alone does not resolve on this index either (a pinned dependency is missing from it), and then
    moeplace is resolved with every other direct requirement of the engine (its metadata's Requires-Dist,
    torch pin included) -- ``resolved_without`` names what was left out.
    """
    req = f"{project}[{extra}]" if extra else str(project)
    ob = ["--only-binary=:all:"] if only_binary else []
    name = engine.split("==")[0].lower()
    rc, out, err, secs = _pip(python, [*ob, req, engine], timeout)
    base = {"engine": engine, "seconds": round(secs, 1)}
    if rc == 0:
        chosen = _chosen(out)
        return {**base, "status": "resolved", "resolved": True, "distributions": len(chosen),
                "torch": chosen.get("torch"), "engine_version": chosen.get(name), "moeplace": chosen.get("moeplace")}
    missing = _missing(err)
    if not missing:
        return {**base, "status": "conflict", "resolved": False, "returncode": rc, "error": _errors(err)}
    # does the engine resolve alone here? If not, the index lacks one of its pins: not moeplace's conflict
    rc_alone, _, err_alone, secs_alone = _pip(python, [*ob, engine], timeout)
    if rc_alone == 0 or sorted(_missing(err_alone)) != sorted(missing):
        return {**base, "status": "conflict", "resolved": False, "returncode": rc, "error": _errors(err)}
    rc_meta, out_meta, err_meta, _ = _pip(python, ["--no-deps", engine], timeout)
    if rc_meta != 0:
        return {**base, "status": "index-incomplete", "resolved": False, "missing": missing,
                "error": _errors(err_meta)}
    meta = json.loads(out_meta)["install"][0]["metadata"]
    skip = {re.split(r"[<>=!~ \[;]", m, maxsplit=1)[0].lower() for m in missing}
    reqs = [r for r in meta.get("requires_dist", []) if "extra ==" not in r
            and re.split(r"[<>=!~ \[;(]", r, maxsplit=1)[0].lower().replace("_", "-") not in skip]
    rc2, out2, err2, secs2 = _pip(python, [*ob, req, *reqs], timeout)
    base["seconds"] = round(secs + secs_alone + secs2, 1)
    if rc2 != 0:
        return {**base, "status": "conflict", "resolved": False, "missing": missing, "error": _errors(err2)}
    chosen = _chosen(out2)
    return {**base, "status": "index-incomplete", "resolved": False, "missing": missing,
            "resolved_without": sorted(skip), "direct_requirements": len(reqs), "distributions": len(chosen),
            "torch": chosen.get("torch"), "moeplace": chosen.get("moeplace")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", action="append", default=None, help=f"engine pin (default: {' and '.join(ENGINES)})")
    ap.add_argument("--extra", default="capture", help="moeplace extra that brings torch (default capture)")
    ap.add_argument("--project", default=str(ROOT), help="moeplace checkout to resolve (default: this one)")
    ap.add_argument("--only-binary", action="store_true", help="pass --only-binary=:all: to pip")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per resolve (default 900)")
    ap.add_argument("--out", default=None, help="results JSON (default bench/results/resolve_engines.json)")
    args = ap.parse_args()
    engines = args.engine or ENGINES
    with tempfile.TemporaryDirectory(prefix="moeplace-resolve-") as tmp:
        venv.EnvBuilder(with_pip=True).create(tmp)
        python = str(Path(tmp) / "bin" / "python")
        pip_version = subprocess.run([python, "-m", "pip", "--version"], check=False, capture_output=True, text=True).stdout.split()[1]
        results = []
        for engine in engines:
            r = resolve(python, Path(args.project), args.extra, engine, args.only_binary, args.timeout)
            results.append(r)
            if r["status"] == "resolved":
                print(f"{engine}: resolved with moeplace[{args.extra}] in {r['seconds']} s "
                      f"(torch {r['torch']}, {r['distributions']} distributions)", flush=True)
            elif r["status"] == "index-incomplete" and "torch" in r:
                print(f"{engine}: the engine alone does not resolve on this index ({', '.join(r['missing'])} is "
                      f"missing from it); moeplace[{args.extra}] resolved with its other {r['direct_requirements']} "
                      f"direct requirements in {r['seconds']} s (torch {r['torch']}, {r['distributions']} "
                      "distributions)", flush=True)
            else:
                print(f"{engine}: NOT resolved with moeplace[{args.extra}] ({r['status']}, {r['seconds']} s): "
                      + " | ".join(r["error"]), flush=True)
    all_resolved = all(r["status"] == "resolved" for r in results)
    no_conflict = all(r["status"] == "resolved" or (r["status"] == "index-incomplete" and "torch" in r)
                      for r in results)
    write_result("resolve_engines", {"extra": args.extra, "only_binary": args.only_binary, "pip": pip_version,
                                     "python": sys.version.split()[0], "all_resolved": all_resolved,
                                     "no_conflict": no_conflict, "results": results},
                 Path(args.out) if args.out else None)
    return 0 if no_conflict else 1


if __name__ == "__main__":
    sys.exit(main())
