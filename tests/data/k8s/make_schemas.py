"""Writes the two schema files beside this script from their published sources (run by hand when they
are refreshed; the tests only read the output):

- ``core-v1.34-strict.schema.json``: the Kubernetes v1.34.0 core objects the manifests use (ConfigMap,
  Service, PodTemplateSpec and every definition they reach), from the "local-strict" JSON schemas of
  kubernetes-json-schema as shipped in the PyPI package kubernetes-validate 1.37.0
  (``kubernetes_validate/kubernetes-json-schema/v1.34.0-local-strict/_definitions.json``, generated from
  the Kubernetes OpenAPI spec; "strict" = ``additionalProperties: false``, as the API server's strict
  field validation refuses unknown fields).
- ``leaderworkerset-v1.schema.json``: the ``openAPIV3Schema`` of version ``v1`` of the LeaderWorkerSet CRD,
  repository kubernetes-sigs/lws, ``config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml`` at
  commit 060ab4da17eea1f0865fcbd3236bb1075e2cea32 (controller-gen v0.17.2).

Both are reduced only by dropping ``description`` texts (they constrain nothing).

    python tests/data/k8s/make_schemas.py _definitions.json leaderworkerset.x-k8s.io_leaderworkersets.yaml
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).parent
ROOTS = ("io.k8s.api.core.v1.ConfigMap", "io.k8s.api.core.v1.Service", "io.k8s.api.core.v1.PodTemplateSpec")
PREFIX = "/api/_definitions.json#/$defs/"


def strip(o):
    if isinstance(o, dict):
        return {k: strip(v) for k, v in o.items() if k != "description"}
    if isinstance(o, list):
        return [strip(x) for x in o]
    if isinstance(o, str) and o.startswith(PREFIX):
        return "#/$defs/" + o[len(PREFIX):]
    return o


def refs(o, out: set[str]) -> None:
    if isinstance(o, dict):
        for k, v in o.items():
            if k == "$ref" and isinstance(v, str):
                out.add(v.rsplit("/", 1)[-1])
            else:
                refs(v, out)
    elif isinstance(o, list):
        for x in o:
            refs(x, out)


def main(definitions: str, crd: str) -> None:
    defs = json.loads(Path(definitions).read_text())["$defs"]
    keep, todo = set(), list(ROOTS)
    while todo:
        name = todo.pop()
        if name in keep:
            continue
        keep.add(name)
        found: set[str] = set()
        refs(defs[name], found)
        todo += sorted(found - keep)
    core = {"$schema": "https://json-schema.org/draft/2020-12/schema",
            "$defs": {k: strip(defs[k]) for k in sorted(keep)}}
    (HERE / "core-v1.34-strict.schema.json").write_text(json.dumps(core, separators=(",", ":"), sort_keys=True) + "\n")
    doc = yaml.safe_load(Path(crd).read_text())
    schema = next(v for v in doc["spec"]["versions"] if v["name"] == "v1")["schema"]["openAPIV3Schema"]
    (HERE / "leaderworkerset-v1.schema.json").write_text(json.dumps(strip(schema), separators=(",", ":"),
                                                                   sort_keys=True) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:3])
