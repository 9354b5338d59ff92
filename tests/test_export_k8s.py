"""The Kubernetes manifests of ``place export --target k8s``: objects the API server accepts.

Each manifest is validated with ``jsonschema`` against the published schemas shipped in
``tests/data/k8s`` (their sources in ``make_schemas.py`` there): the Kubernetes v1.34 core schemas
(ConfigMap, Service, and the pod templates as PodTemplateSpec) and the LeaderWorkerSet CRD's own
``openAPIV3Schema``, made strict the way the API server's strict field validation is (an unknown field is
an error). The sizes are checked against the API server's limits as ``kubectl apply`` meets them
(client-side apply adds the whole object as an annotation): ``kubectl apply --dry-run=client`` cannot say
(it does not reach the server, and needs one to map the LeaderWorkerSet kind), so ``deploy.apply_problems``
computes the annotation kubectl would add."""
from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import yaml
from simkit import random_placement as placement

from moeplace.cli.main import main
from moeplace.foundation.errors import InputError
from moeplace.foundation.model import load_model
from moeplace.placement.export import deploy

DATA = Path(__file__).parent / "data" / "k8s"
CORE = json.loads((DATA / "core-v1.34-strict.schema.json").read_text())
CORE_KINDS = {"ConfigMap": "io.k8s.api.core.v1.ConfigMap", "Service": "io.k8s.api.core.v1.Service"}


def _strict(schema):
    """The CRD schema with unknown fields refused, as the API server's strict field validation does
    (``kubectl apply --validate=strict``, the default): every object schema that lists its properties and
    does not preserve unknown fields gets ``additionalProperties: false``."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) if k not in ("enum", "required") else v for k, v in schema.items()}
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


LWS = _strict(json.loads((DATA / "leaderworkerset-v1.schema.json").read_text()))


def _core(definition: str) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator({"$ref": f"#/$defs/{definition}", "$defs": CORE["$defs"]})


def schema_errors(obj: dict) -> list[str]:
    """Every schema error of one manifest object (empty: valid)."""
    if obj["kind"] == "LeaderWorkerSet":
        errs = list(jsonschema.Draft202012Validator(LWS).iter_errors(obj))
        errs += _core("io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta").iter_errors(obj["metadata"])
        tpl = obj["spec"]["leaderWorkerTemplate"]
        for role in ("leaderTemplate", "workerTemplate"):
            errs += _core("io.k8s.api.core.v1.PodTemplateSpec").iter_errors(tpl[role])
    else:
        errs = list(_core(CORE_KINDS[obj["kind"]]).iter_errors(obj))
    return [f"{obj['kind']} {'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errs]


@pytest.fixture(scope="module")
def pj(tmp_path_factory):
    p = tmp_path_factory.mktemp("pl") / "dsv3.json"
    placement(load_model("deepseek-v3"), 16, 32).save(p)
    return p


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    """Kimi K3 on 4 x 8 GPUs, exported for SGLang with its manifest: the 335 kB file of the finding."""
    d = tmp_path_factory.mktemp("k3")
    placement(load_model("kimi-k3"), 32, 32).save(d / "k3.json")
    assert main(["export", str(d / "k3.json"), "--format", "sglang", "--out", str(d / "loc.json"), "--flags",
                 "--tp", "8", "--dp", "4", "--target", "k8s"]) == 0
    return d


def objects(path: Path) -> list[dict]:
    return list(yaml.safe_load_all(path.read_text()))


def export(tmp_path, pj, fmt, *extra, out="loc.json") -> Path:
    launch_out = tmp_path / f"{fmt}.lws.yaml"
    assert main(["export", str(pj), "--format", fmt, "--out", str(tmp_path / out), "--flags", "--tp", "8",
                 "--dp", "2", "--target", "k8s", "--launch-out", str(launch_out), *extra]) == 0
    return launch_out


# ----------------------------------------------------------------------- schemas
def test_manifests_validate_against_the_core_and_leaderworkerset_schemas(tmp_path, pj, k3):
    manifests = [export(tmp_path, pj, "sglang"), export(tmp_path, pj, "vllm-expert-map", "--vllm-pr", "49572",
                                                        out="map.json"), k3 / "loc.lws.yaml"]
    kinds = []
    for m in manifests:
        assert "&id" not in m.read_text()  # no YAML anchors: plain objects, as kubectl users read them
        for obj in objects(m):
            assert schema_errors(obj) == []
            kinds.append(obj["kind"])
    assert {"ConfigMap", "LeaderWorkerSet", "Service"} == set(kinds)


def test_the_schema_check_refuses_what_the_api_server_would(tmp_path, pj):
    cm, lws, svc = objects(export(tmp_path, pj, "sglang"))
    pod = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]
    pod["hostNetwrk"] = True  # a misspelt field: strict field validation refuses it
    assert any("hostNetwrk" in e for e in schema_errors(lws))
    del pod["hostNetwrk"]
    lws["spec"]["leaderWorkerTemplate"]["size"] = "2"  # a string where the CRD wants an integer
    assert schema_errors(lws)
    svc["spec"]["ports"][0]["port"] = "http"
    assert schema_errors(svc)
    cm["data"] = ["not", "a", "map"]
    assert schema_errors(cm)


# ----------------------------------------------------------------------- sizes
def test_k3_placement_is_split_so_kubectl_apply_accepts_every_object(k3):
    file_bytes = (k3 / "loc.json").read_bytes()
    assert len(file_bytes) > deploy.ANNOTATIONS_LIMIT  # 335 kB: the finding
    # the old layout, one ConfigMap with the file as data: under the 1 MiB ConfigMap limit, but kubectl
    # apply's last-applied annotation would carry all of it
    plain = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"},
             "data": {"loc.json": file_bytes.decode()}}
    assert deploy.apply_sizes(plain)["configmap_data"] < deploy.CONFIGMAP_LIMIT
    assert "over Kubernetes' 262,144" in deploy.apply_problems(plain)[0]
    objs = objects(k3 / "loc.lws.yaml")
    for obj in objs:
        assert deploy.apply_problems(obj) == []
        assert deploy.apply_sizes(obj)["annotations"] <= deploy.ANNOTATIONS_LIMIT
    parts = [o for o in objs if o["kind"] == "ConfigMap"]
    assert parts and all("binaryData" in o for o in parts)
    lws = next(o for o in objs if o["kind"] == "LeaderWorkerSet")
    for role in ("leaderTemplate", "workerTemplate"):
        spec = lws["spec"]["leaderWorkerTemplate"][role]["spec"]
        init = spec["initContainers"][0]
        projected = next(v for v in spec["volumes"] if v["name"] == "placement-parts")["projected"]["sources"]
        assert [s["configMap"]["name"] for s in projected] == [o["metadata"]["name"] for o in parts]
        assert next(v for v in spec["volumes"] if v["name"] == "placement") == {"name": "placement", "emptyDir": {}}
        assert init["command"][-2] == "/etc/moeplace/loc.json"


def _unpack(tmp_path: Path, parts: list[dict], command: list[str]) -> subprocess.CompletedProcess:
    """What the init container does, run here: the ConfigMaps' parts as the kubelet writes them (decoded
    binaryData, one file per key), then the container's own command with the directories moved to tmp."""
    pdir, out = tmp_path / "parts", tmp_path / "etc"
    pdir.mkdir(exist_ok=True)
    out.mkdir(exist_ok=True)
    for o in parts:
        for key, value in o["binaryData"].items():
            (pdir / key).write_bytes(base64.b64decode(value))
    args = [str(pdir), str(out / Path(command[-2]).name), command[-1]]
    assert command[:2] == ["python3", "-c"]
    return subprocess.run([sys.executable, "-c", command[2], *args], check=False, capture_output=True, text=True)


def test_init_container_rebuilds_the_exported_file_and_refuses_foreign_parts(k3, tmp_path):
    objs = objects(k3 / "loc.lws.yaml")
    parts = [o for o in objs if o["kind"] == "ConfigMap"]
    lws = next(o for o in objs if o["kind"] == "LeaderWorkerSet")
    command = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["initContainers"][0]["command"]
    assert _unpack(tmp_path, parts, command).returncode == 0
    assert (tmp_path / "etc" / "loc.json").read_bytes() == (k3 / "loc.json").read_bytes()
    # parts of another export: the digest differs, the pod does not start on them
    (tmp_path / "other").mkdir()
    bad = _unpack(tmp_path / "other", parts, [*command[:-1], "0" * 64])
    assert bad.returncode != 0 and "sha256 differs" in bad.stderr


def test_small_files_stay_one_readable_configmap_and_huge_ones_are_refused(tmp_path, pj, dsv3_launch):
    cm = objects(export(tmp_path, pj, "sglang"))[0]
    assert cm["data"]["loc.json"] == (tmp_path / "loc.json").read_text()
    # bytes that are not UTF-8 (SGLang's .pt form): binaryData, still one ConfigMap, still schema-valid
    pt = b"PK\x03\x04\x80\xff" * 100
    cm = next(yaml.safe_load_all(deploy.k8s_manifest(dsv3_launch, "m", "n", "loc.json", pt)))
    assert base64.b64decode(cm["binaryData"]["loc.json"]) == pt and schema_errors(cm) == []
    # ~3.2 MiB of incompressible bytes (a .pt form): more than MAX_PARTS ConfigMaps' worth
    blob = np.random.default_rng(0).bytes(deploy.PART_BYTES * deploy.MAX_PARTS + 1)
    with pytest.raises(InputError, match="needs more than 16 ConfigMaps; use --target shell/slurm"):
        deploy.k8s_manifest(dsv3_launch, "m", "n", "loc.json", blob)
    # one and a half parts' worth: too big for one ConfigMap's annotation, two ConfigMaps within the limits
    text = deploy.k8s_manifest(dsv3_launch, "m", "n", "loc.json", blob[:deploy.PART_BYTES * 3 // 2])
    parts = [o for o in yaml.safe_load_all(text) if o["kind"] == "ConfigMap"]
    assert len(parts) == 2 and all(deploy.apply_problems(o) == [] for o in parts)


@pytest.fixture()
def dsv3_launch(tmp_path):
    from moeplace.placement.export.flags import FlagOptions, launch_spec

    model = load_model("deepseek-v3")
    return launch_spec(placement(model, 16, 32), model, "sglang", "/etc/moeplace/loc.json", FlagOptions(tp=8, dp=2))


def test_last_applied_is_what_kubectl_writes():
    """Go's encoder: sorted keys, compact, HTML characters escaped, a final newline; the annotation itself
    left out of its own copy."""
    obj = {"kind": "ConfigMap", "apiVersion": "v1",
           "metadata": {"name": "a", "annotations": {deploy.LAST_APPLIED: "old", "b": "x"}}, "data": {"k": "a<b&é"}}
    text = deploy.last_applied(obj)
    assert text == ('{"apiVersion":"v1","data":{"k":"a\\u003cb\\u0026é"},"kind":"ConfigMap",'
                    '"metadata":{"annotations":{"b":"x"},"name":"a"}}\n')
    sizes = deploy.apply_sizes(obj)
    assert sizes["annotations"] == len("b") + len("x") + len(deploy.LAST_APPLIED) + len(text.encode())
    assert sizes["configmap_data"] == len("k") + len("a<b&é".encode())


# ----------------------------------------------------------------------- pods, options, names
def _pods(path: Path) -> list[dict]:
    lws = next(o for o in objects(path) if o["kind"] == "LeaderWorkerSet")
    return [lws["spec"]["leaderWorkerTemplate"][r]["spec"] for r in ("leaderTemplate", "workerTemplate")]


def test_multi_node_pods_get_rdma_ipc_lock_host_network_shm_weights_and_token(tmp_path, pj):
    for spec in _pods(export(tmp_path, pj, "sglang")):
        c = spec["containers"][0]
        assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
        assert c["resources"]["limits"] == {"nvidia.com/gpu": 8, "rdma/ib": 1} == c["resources"]["requests"]
        assert c["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
        vols = {v["name"]: v for v in spec["volumes"]}
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        assert vols["dshm"]["emptyDir"] == {"medium": "Memory"} and mounts["dshm"] == "/dev/shm"
        assert vols["weights"]["persistentVolumeClaim"] == {"claimName": "model-weights"} and mounts["weights"] == "/models"
        env = {e["name"]: e for e in c["env"]}
        assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token", "optional": True}
        assert env["HF_HOME"]["value"] == "/models/huggingface"


def test_pod_options_are_overridable(tmp_path, pj):
    m = export(tmp_path, pj, "sglang", "--k8s-rdma", "nvidia.com/hostdev=2", "--no-k8s-host-network",
               "--no-k8s-ipc-lock", "--k8s-shm-size", "64Gi", "--k8s-weights", "host:/mnt/models",
               "--k8s-weights-mount", "/weights", "--k8s-hf-secret", "gated:hf", "--image", "reg/sglang:mine")
    for spec in _pods(m):
        c = spec["containers"][0]
        assert "hostNetwork" not in spec and "securityContext" not in c and c["image"] == "reg/sglang:mine"
        assert c["resources"]["limits"] == {"nvidia.com/gpu": 8, "nvidia.com/hostdev": 2}
        vols = {v["name"]: v for v in spec["volumes"]}
        assert vols["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Gi"}
        assert vols["weights"]["hostPath"] == {"path": "/mnt/models", "type": "Directory"}
        env = {e["name"]: e for e in c["env"]}
        assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "gated"
        assert env["HF_HOME"]["value"] == "/weights/huggingface"
    for obj in objects(m):
        assert schema_errors(obj) == []
    m = export(tmp_path, pj, "sglang", "--k8s-rdma", "none", "--k8s-weights", "none", "--k8s-hf-secret", "none",
               "--force")
    for spec in _pods(m):
        c = spec["containers"][0]
        assert c["resources"]["limits"] == {"nvidia.com/gpu": 8} and "env" not in c
        assert {v["name"] for v in spec["volumes"]} == {"placement", "dshm"}


def test_one_pod_needs_no_rdma_or_host_network(tmp_path):
    p = tmp_path / "one.json"
    placement(load_model("deepseek-v3"), 8, 24).save(p)
    m = tmp_path / "one.lws.yaml"
    assert main(["export", str(p), "--format", "sglang", "--out", str(tmp_path / "l.json"), "--flags", "--tp", "8",
                 "--target", "k8s", "--launch-out", str(m)]) == 0
    for spec in _pods(m):
        assert "hostNetwork" not in spec and "securityContext" not in spec["containers"][0]
        assert spec["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": 8}


@pytest.mark.parametrize("flag,value,expect", [
    ("--k8s-rdma", "rdma/ib=0", "RESOURCE[=COUNT]"), ("--k8s-rdma", "bad resource", "RESOURCE[=COUNT]"),
    ("--k8s-weights", "nfs:/x", "pvc:CLAIM_NAME"), ("--k8s-weights", "host:relative", "host:/ABSOLUTE/PATH"),
    ("--k8s-weights", "pvc:Bad_Name", "pvc:CLAIM_NAME"), ("--k8s-hf-secret", "Secret!", "NAME[:KEY]"),
    ("--k8s-shm-size", "lots", "quantity"), ("--k8s-weights-mount", "/etc/moeplace", "absolute path other"),
])
def test_bad_pod_options_are_one_line_errors_before_anything_is_written(tmp_path, pj, capsys, flag, value, expect):
    out = tmp_path / "loc.json"
    assert main(["export", str(pj), "--format", "sglang", "--out", str(out), "--flags", "--tp", "8", "--dp", "2",
                 "--target", "k8s", flag, value]) == 2
    err = capsys.readouterr().err
    assert expect in err and flag in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_pod_options_need_target_k8s(tmp_path, pj, capsys):
    assert main(["export", str(pj), "--format", "sglang", "--out", str(tmp_path / "l.json"), "--flags", "--tp", "8",
                 "--dp", "2", "--target", "slurm", "--k8s-rdma", "rdma/ib"]) == 2
    assert "--k8s-rdma is for --target k8s" in capsys.readouterr().err


def test_sglang_and_vllm_manifests_of_one_model_share_a_namespace(tmp_path, pj):
    names = {}
    for fmt, extra, out in (("sglang", [], "loc.json"), ("vllm-expert-map", ["--vllm-pr", "49572"], "map.json")):
        names[fmt] = {(o["kind"], o["metadata"]["name"]) for o in objects(export(tmp_path, pj, fmt, *extra, out=out))}
    assert not names["sglang"] & names["vllm-expert-map"]
    assert ("LeaderWorkerSet", "moeplace-deepseek-v3-sglang") in names["sglang"]
    assert ("LeaderWorkerSet", "moeplace-deepseek-v3-vllm") in names["vllm-expert-map"]
