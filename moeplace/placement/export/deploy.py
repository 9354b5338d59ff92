"""Multi-node launches of an exported placement as files: a shell script, a Slurm batch script, a Kubernetes
LeaderWorkerSet manifest (``place export --flags --target shell|slurm|k8s --launch-out PATH``).

Each is rendered from a :class:`~placement.export.flags.Launch` (the command checked against the engine
release's recorded options) and carries the memory plan's verdict for the layout as a comment (Kubernetes:
also an annotation). Where nodes differ they read two variables: ``NODE_RANK`` (0 on the head node) and
``MASTER_ADDR`` (the head node's address):

- ``shell``: the user sets both on each node and runs the script there; it refuses to start (exit 2, one
  line) when either is unset or ``NODE_RANK`` is not a node index.
- ``slurm``: an ``sbatch`` script, one ``srun`` task per node; ``NODE_RANK`` = ``$SLURM_NODEID``,
  ``MASTER_ADDR`` = the first host of ``$SLURM_JOB_NODELIST``. The placement file must be on a file system
  every node sees, at the path in the command.
- ``k8s``: the placement file in ConfigMap(s), a ``leaderworkerset.x-k8s.io/v1`` LeaderWorkerSet of one
  group of ``nodes`` pods (the leader is node 0) and a Service in front of the leader's HTTP port. The file
  is at :data:`MOUNT_DIR` in every pod, where the command looks for it; ``NODE_RANK`` = ``$LWS_WORKER_INDEX``
  and ``MASTER_ADDR`` = ``$LWS_LEADER_ADDRESS`` (both set by the LeaderWorkerSet controller). What the pods
  get beside the GPUs (RDMA devices, ``IPC_LOCK``, host network, shared memory, a weights volume, the
  Hugging Face token) is a :class:`K8sOptions`, every field overridable from the command line.

Kubernetes size limits (the API server's validation; :func:`apply_problems` checks every object against
them before anything is written): an object's annotations, keys and values together, at most
:data:`ANNOTATIONS_LIMIT` bytes -- and ``kubectl apply`` (client-side) copies the whole object into its
``kubectl.kubernetes.io/last-applied-configuration`` annotation, so each object must serialize within that;
a ConfigMap's data at most :data:`CONFIGMAP_LIMIT` bytes. A placement file whose ConfigMap would break
them (Kimi K3's SGLang file is 335 kB) is gzipped and split over ConfigMaps of binary parts that an init
container joins, checks against the file's SHA-256 and writes to an ``emptyDir`` at :data:`MOUNT_DIR`.
"""
from __future__ import annotations

import base64
import copy
import gzip
import hashlib
import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import yaml

from moeplace.foundation.errors import InputError
from moeplace.foundation.reading import quote
from moeplace.placement.export.flags import Launch, _join

TARGETS = ("shell", "slurm", "k8s")
MARKER = "# moeplace launch:"  # first comment line of every file written here (how a rewrite recognises it)
MOUNT_DIR = "/etc/moeplace"  # where the k8s pods find the placement file
PARTS_DIR = "/etc/moeplace-parts"  # where the init container finds the gzipped parts of a large one
# Kubernetes' limits (apimachinery ValidateAnnotations: TotalAnnotationSizeLimitB = 256 KiB over the sum of
# key and value lengths; core ValidateConfigMap: data plus binaryData at most MaxSecretSize = 1 MiB)
ANNOTATIONS_LIMIT = 256 * 1024
CONFIGMAP_LIMIT = 1024 * 1024
LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"
PART_BYTES = 3 * ((ANNOTATIONS_LIMIT - 8192) // 4)  # raw bytes per part: base64 (4/3) + the object < limit
MAX_PARTS = 16  # ~3 MiB of gzip; beyond that a ConfigMap is the wrong carrier (shared storage is)
IMAGES = {"vllm": "vllm/vllm-openai:v{version}", "sglang": "lmsysorg/sglang:v{version}"}
PORTS = {"vllm": 8000, "sglang": 30000}  # the engines' default HTTP ports

# Joins the parts (sorted by name), gunzips, checks the digest, writes the file: argv = parts dir, file,
# sha256. Python because both engines' images have it; a mismatch (parts from another export) stops the pod.
UNPACK = ("import gzip, hashlib, pathlib, sys\n"
          "parts, out, digest = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3]\n"
          "data = gzip.decompress(b''.join(p.read_bytes() for p in sorted(parts.glob('part-*'))))\n"
          "if hashlib.sha256(data).hexdigest() != digest:\n"
          "    sys.exit(f'{out.name}: the ConfigMap parts are not the exported file (sha256 differs)')\n"
          "out.write_bytes(data)\n")


# Characters no value may carry into a launch file: C0 and C1 controls and DEL (a newline ends a ``#`` comment
# or an ``#SBATCH`` header and starts a shell command; a carriage return hides text on a terminal), and the
# Unicode line and paragraph separators that YAML (and some editors) read as line breaks.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
# ConfigMap keys (Kubernetes IsConfigMapKey): the placement file's name is one, and part of the mount path
_CONFIGMAP_KEY = re.compile(r"^[-._a-zA-Z0-9]{1,253}$")
# A container image reference, as the distribution/reference grammar reads it: [DOMAIN[:PORT]/]PATH[:TAG][@DIGEST];
# the first component is a registry domain only when it holds '.' or ':' or is localhost, and every path
# component is lower case
_DOMAIN = re.compile(r"^(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)*"
                     r"(?::[0-9]+)?$")
_PATH_COMPONENT = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*$")
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_DIGEST = re.compile(r"^[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}$")


def check_value(value: str, what: str) -> str:
    """``value`` unchanged, or an :class:`InputError` naming ``what`` (a flag) when it holds a character no
    launch file may carry (:data:`_CONTROL`: a newline in a path would end the comment or ``#SBATCH`` line
    it is written on and run the rest as a command)."""
    m = _CONTROL.search(value)
    if m:
        raise InputError(f"{what} {quote(value)}: holds a control character ({m.group()!r} at position "
                         f"{m.start()}), which a launch file cannot carry safely (a line break would end a comment "
                         "or header line and run the rest); choose a name without one")
    return value


def comment(text: str) -> str:
    """``text`` as ONE comment line: ``# `` prefixed unless it starts with ``#``; any control character or line
    separator in it (from a file's own fields: a GPU spec's name, a placement's provenance) written as its
    escape, so nothing after it can become a line of its own."""
    safe = _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)
    return safe if safe.startswith("#") else "# " + safe


def check_image(image: str) -> str:
    """``--image``: a container image reference (``[registry[:port]/]name[:tag][@digest]``)."""
    check_value(image, "--image")
    if len(image) > 4096 or not _is_image(image):
        raise InputError(f"--image {quote(image)}: not a container image reference (expected "
                         "[REGISTRY[:PORT]/]NAME[:TAG][@DIGEST], e.g. vllm/vllm-openai:v0.34.0)")
    return image


def _is_image(ref: str) -> bool:
    name, _, digest = ref.partition("@")
    if digest and not _DIGEST.match(digest):
        return False
    parts = name.split("/")
    last, colon, tag = parts[-1].partition(":")
    if colon and not _TAG.match(tag):
        return False
    parts[-1] = last
    domain = len(parts) > 1 and ("." in parts[0] or ":" in parts[0] or parts[0] == "localhost")
    if domain and not _DOMAIN.match(parts.pop(0)):
        return False
    return all(_PATH_COMPONENT.match(c) for c in parts)


def check_launch(launch: Launch, target: str, file_name: str | None = None) -> None:
    """Every value of ``launch`` a ``target`` file carries is one the file can hold: no control characters in
    the placement file's path (``--out``), the model path (``--model-path``), the environment or any word of
    the command; under ``k8s`` the file name is a ConfigMap key. Raises :class:`InputError` naming the flag."""
    check_value(launch.file_path, "--out")
    check_value(launch.model_path, "--model-path")
    for k, v in launch.env.items():
        check_value(k, "the engine environment's name")
        check_value(v, f"{k} (the placement JSON given to export)")
    for word in [*launch.head, *(launch.worker_extra or [])]:
        check_value(word, "a word of the launch command")
    if target == "k8s" and file_name is not None and not _CONFIGMAP_KEY.match(file_name):
        raise InputError(f"--out {quote(file_name)}: --target k8s carries the file in a ConfigMap under its name, "
                         "which Kubernetes allows only letters, digits, '-', '_' and '.' (at most 253); rename it")


def default_suffix(target: str) -> str:
    return {"shell": ".launch.sh", "slurm": ".sbatch", "k8s": ".lws.yaml"}[target]


def is_launch_file(path: str | Path) -> bool:
    """Whether ``path`` was written by :func:`render` (its marker line is among the first lines)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        head = [f.readline() for _ in range(3)]
    return any(line.startswith(MARKER) for line in head)


def _check(launch: Launch, target: str) -> None:
    if target not in TARGETS:
        raise InputError(f"--target must be one of {', '.join(TARGETS)}, got '{target}'")
    if launch.version is None:  # only the vLLM and SGLang commands are checked against a release
        raise InputError(f"--target {target}: launch files are written for the SGLang and vLLM formats "
                         "(the others print their command only)")
    check_launch(launch, target)


def _node_body(launch: Launch, indent: str) -> list[str]:
    """The shell lines that start this node's engine process (``NODE_RANK`` chooses head or worker); the
    launch's environment (the vLLM plugin's switch, ``MOEPLACE_PLACEMENT``) is exported first."""
    env = [f"{indent}export {k}={shlex.quote(v)}" for k, v in launch.env.items()]
    return env + _exec_lines(launch, indent)


def _exec_lines(launch: Launch, indent: str) -> list[str]:
    head = _join(launch.head).replace("\n", "\n" + indent)
    if launch.nodes == 1 or not launch.worker_extra:
        return [indent + "exec " + head]
    worker = _join(launch.head + launch.worker_extra).replace("\n", "\n" + indent + "  ")
    return [f'{indent}if [ "$NODE_RANK" -eq 0 ]; then',
            f"{indent}  exec " + head.replace("\n", "\n  "),
            f"{indent}else",
            f"{indent}  exec " + worker,
            f"{indent}fi"]


def _header(launch: Launch, target: str, memory: str) -> list[str]:
    """The comment lines every launch file starts with (each one line, whatever its values hold)."""
    first = (f"{MARKER} {launch.engine} {launch.version}, {launch.nodes} node(s) x {launch.gpus_per_node} GPUs "
             f"(place export --target {target})")
    return [comment(line) for line in (first, memory, *launch.notes, launch.layout)]


def _refuse(message: str) -> str:
    """A shell command printing ``message`` to stderr and exiting 2 (the message quoted as one word)."""
    return f"{{ printf '%s\\n' {shlex.quote('launch: ' + message)} >&2; exit 2; }}"


def _node_checks(nodes: int) -> list[str]:
    """Lines that stop the script before the engine starts unless ``NODE_RANK`` is an index 0..nodes-1 and
    ``MASTER_ADDR`` is set. Plain ``if``/``case`` with quoted messages: prose inside ``${VAR:?...}`` is
    parsed as shell words (an apostrophe there opens a quote)."""
    bad_rank = _refuse(f"set NODE_RANK to this node's index, 0..{nodes - 1}")
    return ['case "${NODE_RANK:-}" in',
            f"  ''|*[!0-9]*) {bad_rank} ;;",
            "esac",
            f'[ "$NODE_RANK" -lt {nodes} ] || {bad_rank}',
            f'[ -n "${{MASTER_ADDR:-}}" ] || {_refuse("set MASTER_ADDR to the head node address")}']


def shell_script(launch: Launch, memory: str) -> str:
    _check(launch, "shell")
    lines = ["#!/usr/bin/env bash", *_header(launch, "shell", memory)]
    if launch.nodes > 1:
        lines.append(f"# run on each of the {launch.nodes} nodes: NODE_RANK=0..{launch.nodes - 1} (0 = head), "
                     "MASTER_ADDR = the head node's address")
    lines.append("set -euo pipefail")
    if launch.nodes > 1:
        lines += _node_checks(launch.nodes)
    lines += _node_body(launch, "")
    return "\n".join(lines) + "\n"


def slurm_script(launch: Launch, memory: str, job_name: str) -> str:
    _check(launch, "slurm")
    n, gpn = launch.nodes, launch.gpus_per_node
    lines = ["#!/bin/bash", *_header(launch, "slurm", memory),
             comment(f"the placement file must be readable on every node at {launch.file_path}"),
             f"#SBATCH --job-name={k8s_name(job_name)}", f"#SBATCH --nodes={n}", "#SBATCH --ntasks-per-node=1",
             f"#SBATCH --gpus-per-node={gpn}", "#SBATCH --exclusive",
             "set -euo pipefail",
             # all hosts read, then the first taken: `| head -n 1` under pipefail can fail on SIGPIPE
             'mapfile -t HOSTS < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
             'MASTER_ADDR=${HOSTS[0]}',
             "export MASTER_ADDR",
             "node_main() {",
             "  NODE_RANK=$SLURM_NODEID",
             *_node_body(launch, "  "),
             "}",
             "export -f node_main",
             f"srun --nodes={n} --ntasks-per-node=1 bash -c node_main"]
    return "\n".join(lines) + "\n"


def k8s_name(text: str) -> str:
    """An RFC 1123 label that also starts with a letter (RFC 1035, as Service names must): lower case,
    digits, '-'; at most 52 characters, leaving room for the suffixes the objects add (``-placement-15``,
    ``-api``). Any other character of ``text`` becomes '-'."""
    name = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    if name and not name[0].isalpha():
        name = "m-" + name
    name = name[:52].strip("-")
    return name or "moeplace"


# ----------------------------------------------------------------------- what the pods get beside the GPUs
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_RESOURCE = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")
_SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]{1,253}$")


@dataclass(frozen=True)
class Rdma:
    """An extended resource that gives a pod the nodes' RDMA NICs (name as the cluster's device plugin
    registers it: ``rdma/ib``, ``rdma/rdma_shared_device_a``, ``nvidia.com/hostdev``, ...)."""

    resource: str = "rdma/ib"
    count: int = 1


@dataclass(frozen=True)
class PvcWeights:
    """Model weights on a PersistentVolumeClaim (ReadWriteMany or ReadOnlyMany: every pod mounts it)."""

    claim: str

    def volume(self) -> dict:
        return {"persistentVolumeClaim": {"claimName": self.claim}}

    def describe(self) -> str:
        return f"PersistentVolumeClaim {self.claim}"


@dataclass(frozen=True)
class HostPathWeights:
    """Model weights in a directory present on every node (a local disk or a node-mounted file system)."""

    path: str

    def volume(self) -> dict:
        return {"hostPath": {"path": self.path, "type": "Directory"}}

    def describe(self) -> str:
        return f"host directory {self.path}"


WEIGHT_SOURCES = {"pvc": PvcWeights, "host": HostPathWeights}


@dataclass(frozen=True)
class SecretRef:
    """``HF_TOKEN`` from key ``key`` of Secret ``name`` (optional: a public model needs none)."""

    name: str = "hf-token"
    key: str = "token"


AUTO = "auto"  # RDMA, host network and IPC_LOCK: on for a multi-node group, off for one pod


@dataclass(frozen=True)
class K8sOptions:
    """What the LeaderWorkerSet pods get beside the GPUs (``place export --target k8s`` flags in brackets).

    ``rdma`` [``--k8s-rdma``]: the RDMA resource each pod requests (DeepEP / NCCL between nodes), ``None``
    none; ``host_network`` [``--k8s-host-network``]: the pods use the nodes' network (the RDMA NICs and
    their addresses as the engines' all-to-all and NCCL expect them; with ``dnsPolicy:
    ClusterFirstWithHostNet`` so the leader's name still resolves); ``ipc_lock`` [``--k8s-ipc-lock``]: the
    ``IPC_LOCK`` capability (RDMA pins memory). Each :data:`AUTO`: on when the group has more than one pod.
    ``shm_size`` [``--k8s-shm-size``]: the memory-backed ``/dev/shm`` (``None``: no size limit);
    ``weights`` [``--k8s-weights``]: the volume mounted at ``weights_mount`` [``--k8s-weights-mount``] in
    every pod, with ``HF_HOME`` inside it so a Hugging Face id downloads there once (``None``: none);
    ``hf_secret`` [``--k8s-hf-secret``]: ``HF_TOKEN`` for gated weights; ``image`` [``--image``]: the
    container (default: the engine's published image of the checked release)."""

    rdma: Rdma | None | str = AUTO
    host_network: bool | str = AUTO
    ipc_lock: bool | str = AUTO
    shm_size: str | None = None
    weights: PvcWeights | HostPathWeights | None = PvcWeights("model-weights")
    weights_mount: str = "/models"
    hf_secret: SecretRef | None = SecretRef()
    image: str | None = None

    def resolved(self, nodes: int) -> K8sOptions:
        """The options with every :data:`AUTO` decided for a group of ``nodes`` pods."""
        multi = nodes > 1
        return K8sOptions(rdma=(Rdma() if multi else None) if self.rdma == AUTO else self.rdma,
                          host_network=multi if self.host_network == AUTO else self.host_network,
                          ipc_lock=multi if self.ipc_lock == AUTO else self.ipc_lock, shm_size=self.shm_size,
                          weights=self.weights, weights_mount=self.weights_mount, hf_secret=self.hf_secret,
                          image=self.image)


def parse_rdma(text: str) -> Rdma | None | str:
    """``--k8s-rdma``: ``auto``, ``none`` or ``RESOURCE[=COUNT]``."""
    if text in (AUTO, "none"):
        return None if text == "none" else AUTO
    name, sep, count = text.partition("=")
    if not _RESOURCE.match(name) or (sep and not count.isdigit()) or (sep and int(count) < 1):
        raise InputError(f"--k8s-rdma {text!r}: expected auto, none or RESOURCE[=COUNT] (a resource name such as "
                         "rdma/ib, a count >= 1)")
    return Rdma(name, int(count) if sep else 1)


def parse_weights(text: str) -> PvcWeights | HostPathWeights | None:
    """``--k8s-weights``: ``pvc:CLAIM``, ``host:/ABSOLUTE/PATH`` or ``none``."""
    if text == "none":
        return None
    kind, sep, value = text.partition(":")
    source = WEIGHT_SOURCES.get(kind)
    check_value(text, "--k8s-weights")
    ok = source is PvcWeights and _DNS_SUBDOMAIN.match(value) or source is HostPathWeights and value.startswith("/")
    if not sep or not ok:
        raise InputError(f"--k8s-weights {text!r}: expected pvc:CLAIM_NAME (a lower-case DNS name), "
                         "host:/ABSOLUTE/PATH or none")
    return source(value)


def parse_secret(text: str) -> SecretRef | None:
    """``--k8s-hf-secret``: ``NAME[:KEY]`` or ``none``."""
    if text == "none":
        return None
    name, sep, key = text.partition(":")
    if not _DNS_SUBDOMAIN.match(name) or (sep and not _SECRET_KEY.match(key)):
        raise InputError(f"--k8s-hf-secret {text!r}: expected NAME[:KEY] (a Secret name, a key of "
                         "letters, digits, '-', '_', '.') or none")
    return SecretRef(name, key if sep else "token")


def parse_quantity(text: str, flag: str) -> str:
    if not _QUANTITY.match(text):
        raise InputError(f"{flag} {text!r}: expected a Kubernetes quantity such as 64Gi or 500Mi")
    return text


def parse_mount(text: str) -> str:
    check_value(text, "--k8s-weights-mount")
    if not text.startswith("/") or text.rstrip("/") in ("", MOUNT_DIR, PARTS_DIR, "/dev/shm") or ":" in text:
        raise InputError(f"--k8s-weights-mount {text!r}: expected an absolute path other than /, /dev/shm and "
                         f"{MOUNT_DIR}")
    return text.rstrip("/")


# ----------------------------------------------------------------------- sizes Kubernetes accepts
def last_applied(obj: dict) -> str:
    """What ``kubectl apply`` (client-side) stores in ``kubectl.kubernetes.io/last-applied-configuration``:
    the object as compact JSON, as Go's encoder writes it (map keys sorted, ``<``, ``>``, ``&`` escaped as
    ``\\u003c`` ..., a newline at the end)."""
    meta = dict(obj.get("metadata", {}))
    meta["annotations"] = {k: v for k, v in meta.get("annotations", {}).items() if k != LAST_APPLIED}
    if not meta["annotations"]:
        del meta["annotations"]
    text = json.dumps({**obj, "metadata": meta}, separators=(",", ":"), sort_keys=True, ensure_ascii=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026") + "\n"


def apply_sizes(obj: dict) -> dict[str, int]:
    """``annotations``: bytes of the object's annotations once ``kubectl apply`` has added its own (keys and
    values, UTF-8); ``configmap_data`` (ConfigMaps): bytes of data and binaryData (keys and decoded values)."""
    notes = {**obj.get("metadata", {}).get("annotations", {}), LAST_APPLIED: last_applied(obj)}
    out = {"annotations": sum(len(k.encode()) + len(v.encode()) for k, v in notes.items())}
    if obj.get("kind") == "ConfigMap":
        data = sum(len(k.encode()) + len(v.encode()) for k, v in obj.get("data", {}).items())
        binary = sum(len(k.encode()) + len(base64.b64decode(v)) for k, v in obj.get("binaryData", {}).items())
        out["configmap_data"] = data + binary
    return out


def apply_problems(obj: dict) -> list[str]:
    """Why the API server would refuse ``obj`` under ``kubectl apply`` (empty: it accepts the sizes)."""
    sizes = apply_sizes(obj)
    what = f"{obj.get('kind')} {obj.get('metadata', {}).get('name')}"
    out = []
    if sizes["annotations"] > ANNOTATIONS_LIMIT:
        out.append(f"{what}: annotations with kubectl's last-applied copy are {sizes['annotations']:,} bytes, "
                   f"over Kubernetes' {ANNOTATIONS_LIMIT:,}")
    if sizes.get("configmap_data", 0) > CONFIGMAP_LIMIT:
        out.append(f"{what}: {sizes['configmap_data']:,} bytes of data, over Kubernetes' {CONFIGMAP_LIMIT:,}")
    return out


# ----------------------------------------------------------------------- the manifest
@dataclass(frozen=True)
class _Carrier:
    """How the placement file reaches the pods: ConfigMap objects, the pod volumes that show them, and the
    init container (if any) that rebuilds the file at ``MOUNT_DIR``."""

    configmaps: list[dict]
    volumes: list[dict]
    init: list[dict]


def _carrier(name: str, app: dict, file_name: str, file_bytes: bytes, image: str) -> _Carrier:
    """One ConfigMap holding the file as it is when its objects pass :func:`apply_problems`; else the file
    gzipped in :data:`PART_BYTES` parts over ConfigMaps ``NAME-placement-0..``, joined by an init container."""
    try:
        cm: dict = {"data": {file_name: file_bytes.decode("utf-8")}}
    except UnicodeDecodeError:  # SGLang's .pt form
        cm = {"binaryData": {file_name: base64.b64encode(file_bytes).decode("ascii")}}
    whole = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"{name}-placement", "labels": app},
             **cm}
    if not apply_problems(whole):
        return _Carrier([whole], [{"name": "placement", "configMap": {"name": f"{name}-placement"}}], [])
    packed = gzip.compress(file_bytes, mtime=0)  # mtime 0: the same file gives the same manifest
    parts = [packed[i:i + PART_BYTES] for i in range(0, len(packed), PART_BYTES)]
    if len(parts) > MAX_PARTS:
        raise InputError(f"{file_name}: {len(file_bytes) / 2**20:.1f} MiB ({len(packed) / 2**20:.1f} MiB gzipped) "
                         f"needs more than {MAX_PARTS} ConfigMaps; use --target shell/slurm with the file on "
                         "shared storage")
    digest = hashlib.sha256(file_bytes).hexdigest()
    maps = [{"apiVersion": "v1", "kind": "ConfigMap",
             "metadata": {"name": f"{name}-placement-{i}", "labels": app,
                          "annotations": {"moeplace/part": f"{i + 1} of {len(parts)} of {file_name}.gz",
                                          "moeplace/sha256": digest}},
             "binaryData": {f"part-{i:03d}": base64.b64encode(part).decode("ascii")}}
            for i, part in enumerate(parts)]
    volumes = [{"name": "placement", "emptyDir": {}},
               {"name": "placement-parts", "projected": {"sources": [
                   {"configMap": {"name": m["metadata"]["name"]}} for m in maps]}}]
    init = [{"name": "unpack-placement", "image": image,
             "command": ["python3", "-c", UNPACK, PARTS_DIR, f"{MOUNT_DIR}/{file_name}", digest],
             "volumeMounts": [{"name": "placement-parts", "mountPath": PARTS_DIR, "readOnly": True},
                              {"name": "placement", "mountPath": MOUNT_DIR}]}]
    return _Carrier(maps, volumes, init)


def k8s_manifest(launch: Launch, memory: str, name: str, file_name: str, file_bytes: bytes,
                 options: K8sOptions | None = None) -> str:
    """The placement file's ConfigMap(s), a LeaderWorkerSet running ``launch`` and a Service in front of
    the leader (YAML documents). ``launch`` must have been built with the file at ``MOUNT_DIR/file_name``.
    Every object passes :func:`apply_problems` (else a one-line InputError)."""
    _check(launch, "k8s")
    check_launch(launch, "k8s", file_name)
    if launch.env:  # the vLLM plugin reads the placement JSON, which the ConfigMap does not carry
        raise InputError(f"--target k8s: this command loads the placement through the moeplace plugin "
                         f"({', '.join(launch.env)}), whose placement JSON the manifest does not mount; use --target "
                         "shell/slurm with the file on shared storage")
    expected = f"{MOUNT_DIR}/{file_name}"
    if launch.file_path != expected:
        raise InputError(f"--target k8s: the command must load the placement from {expected} (where the "
                         f"file is mounted), not {launch.file_path}")
    opts = (options or K8sOptions()).resolved(launch.nodes)
    name = k8s_name(name)
    app = {"app": name}
    image = check_image(opts.image) if opts.image else IMAGES[launch.engine].format(version=launch.version)
    carrier = _carrier(name, app, file_name, file_bytes, image)
    env_line = "export NODE_RANK=$LWS_WORKER_INDEX MASTER_ADDR=$LWS_LEADER_ADDRESS"
    port = PORTS[launch.engine]
    limits: dict = {"nvidia.com/gpu": launch.gpus_per_node}
    if opts.rdma is not None:
        limits[opts.rdma.resource] = opts.rdma.count
    env = []
    if opts.hf_secret is not None:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": opts.hf_secret.name, "key": opts.hf_secret.key, "optional": True}}})
    mounts = [{"name": "placement", "mountPath": MOUNT_DIR, "readOnly": True},
              {"name": "dshm", "mountPath": "/dev/shm"}]
    volumes = [*carrier.volumes, {"name": "dshm", "emptyDir": {"medium": "Memory", **(
        {"sizeLimit": opts.shm_size} if opts.shm_size else {})}}]
    if opts.weights is not None:
        env.append({"name": "HF_HOME", "value": f"{opts.weights_mount}/huggingface"})
        mounts.append({"name": "weights", "mountPath": opts.weights_mount})
        volumes.append({"name": "weights", **opts.weights.volume()})

    def pod(role: str, worker: bool) -> dict:
        cmd = " ".join(launch.head + (launch.worker_extra or [] if worker else []))
        container = {"name": launch.engine, "image": image, "command": ["/bin/bash", "-c"],
                     "args": [f"{env_line}\nexec {cmd}\n"],
                     **({"env": env} if env else {}),
                     **({"ports": [{"containerPort": port, "name": "http"}]} if not worker else {}),
                     "resources": {"limits": dict(limits), "requests": dict(limits)},
                     **({"securityContext": {"capabilities": {"add": ["IPC_LOCK"]}}} if opts.ipc_lock else {}),
                     "volumeMounts": mounts}
        spec: dict = {}
        if opts.host_network:
            spec.update(hostNetwork=True, dnsPolicy="ClusterFirstWithHostNet")
        if carrier.init:
            spec["initContainers"] = carrier.init
        spec.update(containers=[container], volumes=volumes)
        # copies: shared dicts would come out of yaml.safe_dump as anchors and aliases
        return copy.deepcopy({"metadata": {"labels": {**app, "role": role}}, "spec": spec})

    lws = {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
           "metadata": {"name": name, "labels": app,
                        "annotations": {"moeplace/memory-plan": memory,
                                        "moeplace/engine": f"{launch.engine} {launch.version}",
                                        "moeplace/layout": launch.layout.lstrip("# ")}},
           "spec": {"replicas": 1, "leaderWorkerTemplate": {
               "size": launch.nodes, "restartPolicy": "RecreateGroupOnPodRestart",
               "leaderTemplate": pod("leader", False), "workerTemplate": pod("worker", True)}}}
    # the LeaderWorkerSet's own headless Service is named NAME (LWS_LEADER_ADDRESS); this one serves clients
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": f"{name}-api", "labels": app},
               "spec": {"selector": {"leaderworkerset.sigs.k8s.io/name": name, "role": "leader"},
                        "ports": [{"name": "http", "port": port, "targetPort": port, "protocol": "TCP"}]}}
    objects = [*carrier.configmaps, lws, service]
    problems = [p for o in objects for p in apply_problems(o)]
    if problems:
        raise InputError(f"--target k8s: {problems[0]}")
    net = ("host network" if opts.host_network else "pod network") + (
        f", {opts.rdma.count} x {opts.rdma.resource}" if opts.rdma else ", no RDMA resource") + (
        ", IPC_LOCK" if opts.ipc_lock else "")
    carried = (f"# the placement file: ConfigMap {name}-placement" if not carrier.init else
               f"# the placement file: gzipped over {len(carrier.configmaps)} ConfigMap(s) {name}-placement-N, "
               "joined by the init container")
    head = [(f"{MARKER} {launch.engine} {launch.version}, {launch.nodes} pod(s) x {launch.gpus_per_node} GPUs "
            "(place export --target k8s; needs the LeaderWorkerSet controller)"), memory, *launch.notes,
            launch.layout, f"image {image}: " + ("--image" if opts.image else "the engine's published container "
                                                 "(--image overrides)"),
            f"pods: {net}; /dev/shm in memory" + (f" ({opts.shm_size})" if opts.shm_size else ""),
            (f"weights: {opts.weights.describe()} at {opts.weights_mount} (HF_HOME inside)" if opts.weights
             else "weights: no volume (--k8s-weights)"),
            (f"HF_TOKEN: Secret {opts.hf_secret.name}, key {opts.hf_secret.key} (optional)" if opts.hf_secret
             else "HF_TOKEN: none"),
            carried, f"client traffic: Service {name}-api port {port}",
            "every object is within Kubernetes' size limits for kubectl apply (client- or server-side)"]
    # every value below the comments is a YAML scalar that safe_dump quotes by YAML's own rules
    docs = [yaml.safe_dump(d, sort_keys=False, width=120) for d in objects]
    return "\n".join(comment(line) for line in head) + "\n" + "---\n".join(docs)


def render(target: str, launch: Launch, memory: str, *, name: str, file_name: str, file_bytes: bytes | None,
           k8s: K8sOptions | None = None) -> str:
    if target == "shell":
        return shell_script(launch, memory)
    if target == "slurm":
        return slurm_script(launch, memory, k8s_name(name))
    if file_bytes is None:
        raise InputError("--target k8s needs the exported file's bytes")
    return k8s_manifest(launch, memory, name, file_name, file_bytes, k8s)



# ----------------------------------------------------------------------- a disaggregated deployment's pools
def render_pools(target: str, pools: list[tuple[str, Launch, str, str, bytes]], *, name: str,
                 k8s: K8sOptions | None = None) -> str:
    """One launch file that starts every pool of a disaggregated deployment. ``pools``: ``(role, launch,
    memory line, file name, file bytes)`` per pool, prefill first.

    - ``shell``: ``POOL`` (``prefill`` | ``decode``) chooses the pool, then ``NODE_RANK`` / ``MASTER_ADDR``
      the node within it, as for one pool.
    - ``slurm``: a heterogeneous job, one component per pool (``#SBATCH hetjob``); each pool's nodes start
      under ``srun --het-group=N`` with ``NODE_RANK`` = ``$SLURM_NODEID`` within the step and ``MASTER_ADDR``
      = the first host of its component (``$SLURM_JOB_NODELIST_HET_GROUP_N``).
    - ``k8s``: each pool's ConfigMap(s), LeaderWorkerSet and Service, named ``NAME-prefill`` / ``NAME-decode``.
    """
    for _, launch, *_ in pools:
        _check(launch, target)
    roles = [r for r, *_ in pools]
    if target == "k8s":
        docs = [k8s_manifest(launch, memory, f"{name}-{role}", file_name, file_bytes, k8s)
                for role, launch, memory, file_name, file_bytes in pools]
        return "---\n".join(d if d.endswith("\n") else d + "\n" for d in docs)
    head = [f"{MARKER} disaggregated {', '.join(roles)} pools (place export --pools --target {target})"]
    for role, launch, memory, *_ in pools:
        first, *rest = _header(launch, target, memory)  # every line escaped as one comment line
        head += [f"# {role}: " + first[len(MARKER) + 1:], comment(f"{role}: {memory}"), *rest[1:]]
    if target == "shell":
        lines = ["#!/usr/bin/env bash", *head,
                 (f"# run on every node of each pool: POOL={'|'.join(roles)}, NODE_RANK = the node's index in its "
                  "pool (0 = its head), MASTER_ADDR = its pool's head node"),
                 "set -euo pipefail",
                 'case "${POOL:-}" in']
        for role, launch, *_ in pools:
            lines.append(f"  {role})")
            if launch.nodes > 1:
                lines += ["    " + x for x in _node_checks(launch.nodes)]
            lines += _node_body(launch, "    ")
            lines.append("    ;;")
        lines += [f"  *) {_refuse('set POOL to ' + ' or '.join(roles))} ;;", "esac"]
        return "\n".join(lines) + "\n"
    if target != "slurm":
        raise InputError(f"--target must be one of {', '.join(TARGETS)}, got '{target}'")
    lines = ["#!/bin/bash", *head]
    for i, (role, launch, *_) in enumerate(pools):
        if i:
            lines.append("#SBATCH hetjob")
        lines += ([f"#SBATCH --job-name={k8s_name(name)}"] if not i else []) + [
                  f"#SBATCH --nodes={launch.nodes}", "#SBATCH --ntasks-per-node=1",
                  f"#SBATCH --gpus-per-node={launch.gpus_per_node}", "#SBATCH --exclusive"]
    lines.append("set -euo pipefail")
    for i, (role, launch, *_) in enumerate(pools):
        lines += [f"# {role}: component {i}; the placement file must be readable on its nodes at {launch.file_path}",
                  f"{role}_main() {{",
                  f'  mapfile -t HOSTS < <(scontrol show hostnames "$SLURM_JOB_NODELIST_HET_GROUP_{i}")',
                  '  export MASTER_ADDR=${HOSTS[0]}',
                  "  NODE_RANK=$SLURM_NODEID",
                  *_node_body(launch, "  "),
                  "}",
                  f"export -f {role}_main",
                  f"srun --het-group={i} --nodes={launch.nodes} --ntasks-per-node=1 bash -c {role}_main &"]
    lines.append("wait")
    return "\n".join(lines) + "\n"
