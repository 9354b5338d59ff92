"""Multi-node launches of an exported placement as files: a shell script, a Slurm batch script, a Kubernetes
LeaderWorkerSet manifest (``place export --flags --target shell|slurm|k8s --launch-out PATH``).

Each is rendered from a :class:`~placement.export.flags.Launch` (the command checked against the engine
release's recorded options) and carries the memory plan's verdict for the layout as a comment (Kubernetes:
also an annotation). Where nodes differ they read two variables: ``NODE_RANK`` (0 on the head node) and
``MASTER_ADDR`` (the head node's address):

- ``shell``: the user sets both on each node and runs the script there.
- ``slurm``: an ``sbatch`` script, one ``srun`` task per node; ``NODE_RANK`` = ``$SLURM_NODEID``,
  ``MASTER_ADDR`` = the first host of ``$SLURM_JOB_NODELIST``. The placement file must be on a file system
  every node sees, at the path in the command.
- ``k8s``: a ConfigMap holding the placement file and a ``leaderworkerset.x-k8s.io/v1`` LeaderWorkerSet of
  one group of ``nodes`` pods (the leader is node 0); the ConfigMap is mounted at :data:`MOUNT_DIR`, where
  the command looks for the file; ``NODE_RANK`` = ``$LWS_WORKER_INDEX`` and ``MASTER_ADDR`` =
  ``$LWS_LEADER_ADDRESS`` (both set by the LeaderWorkerSet controller in every container).
"""
from __future__ import annotations

import base64
import re
import shlex
from pathlib import Path

import yaml

from moeplace.foundation.errors import InputError
from moeplace.placement.export.flags import Launch, _join

TARGETS = ("shell", "slurm", "k8s")
MARKER = "# moeplace launch:"  # first comment line of every file written here (how a rewrite recognises it)
MOUNT_DIR = "/etc/moeplace"  # where the k8s manifest mounts the placement file
CONFIGMAP_LIMIT = 1024 * 1024  # Kubernetes refuses a ConfigMap over 1 MiB
IMAGES = {"vllm": "vllm/vllm-openai:v{version}", "sglang": "lmsysorg/sglang:v{version}"}
PORTS = {"vllm": 8000, "sglang": 30000}  # the engines' default HTTP ports


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


def _node_body(launch: Launch, indent: str) -> list[str]:
    """The shell lines that start this node's engine process (``NODE_RANK`` chooses head or worker);
    the launch's environment (the vLLM plugin's switch) is exported first."""
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
    return [(f"{MARKER} {launch.engine} {launch.version}, {launch.nodes} node(s) x {launch.gpus_per_node} GPUs "
            f"(place export --target {target})"),
            f"# {memory}", *launch.notes, launch.layout]


def shell_script(launch: Launch, memory: str) -> str:
    _check(launch, "shell")
    lines = ["#!/usr/bin/env bash", *_header(launch, "shell", memory)]
    if launch.nodes > 1:
        lines.append(f"# run on each of the {launch.nodes} nodes: NODE_RANK=0..{launch.nodes - 1} (0 = head), "
                     "MASTER_ADDR = the head node's address")
    lines.append("set -euo pipefail")
    if launch.nodes > 1:
        lines += [f': "${{NODE_RANK:?set NODE_RANK to this node\'s index, 0..{launch.nodes - 1}}}"',
                  ': "${MASTER_ADDR:?set MASTER_ADDR to the head node\'s address}"']
    lines += _node_body(launch, "")
    return "\n".join(lines) + "\n"


def slurm_script(launch: Launch, memory: str, job_name: str) -> str:
    _check(launch, "slurm")
    n, gpn = launch.nodes, launch.gpus_per_node
    lines = ["#!/bin/bash", *_header(launch, "slurm", memory),
             f"# the placement file must be readable on every node at {launch.file_path}",
             f"#SBATCH --job-name={job_name}", f"#SBATCH --nodes={n}", "#SBATCH --ntasks-per-node=1",
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
    """An RFC 1123 name (lower case, digits, '-'; at most 52 characters, leaving room for suffixes)."""
    name = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:52].strip("-")
    return name or "moeplace"


def k8s_manifest(launch: Launch, memory: str, name: str, file_name: str, file_bytes: bytes,
                 image: str | None = None) -> str:
    """A ConfigMap with the placement file plus a LeaderWorkerSet running ``launch`` (YAML, two documents).
    ``launch`` must have been built with the file at ``MOUNT_DIR/file_name``."""
    _check(launch, "k8s")
    if launch.env:  # the vLLM plugin reads the placement JSON, which the ConfigMap does not carry
        raise InputError(f"--target k8s: this command loads the placement through the moeplace plugin "
                         f"({', '.join(launch.env)}), whose placement JSON the manifest does not mount; use --target "
                         "shell/slurm with the file on shared storage")
    expected = f"{MOUNT_DIR}/{file_name}"
    if launch.file_path != expected:
        raise InputError(f"--target k8s: the command must load the placement from {expected} (where the "
                         f"ConfigMap is mounted), not {launch.file_path}")
    if len(file_bytes) > CONFIGMAP_LIMIT:
        raise InputError(f"{file_name}: {len(file_bytes) / 2**20:.1f} MiB is over Kubernetes' 1 MiB ConfigMap "
                         "limit; use --target shell/slurm with the file on shared storage")
    name = k8s_name(name)
    image = image or IMAGES[launch.engine].format(version=launch.version)
    try:
        cm: dict = {"data": {file_name: file_bytes.decode("utf-8")}}
    except UnicodeDecodeError:  # SGLang's .pt form
        cm = {"binaryData": {file_name: base64.b64encode(file_bytes).decode("ascii")}}
    configmap = {"apiVersion": "v1", "kind": "ConfigMap",
                 "metadata": {"name": f"{name}-placement", "labels": {"app": name}}, **cm}
    env_line = "export NODE_RANK=$LWS_WORKER_INDEX MASTER_ADDR=$LWS_LEADER_ADDRESS"

    def pod(role: str, worker: bool) -> dict:
        cmd = " ".join(launch.head + (launch.worker_extra or [] if worker else []))
        script = f"{env_line}\nexec {cmd}\n"
        return {"metadata": {"labels": {"app": name, "role": role}},
                "spec": {"containers": [{
                    "name": launch.engine, "image": image, "command": ["/bin/bash", "-c"], "args": [script],
                    "ports": [{"containerPort": PORTS[launch.engine]}] if not worker else [],
                    "resources": {"limits": {"nvidia.com/gpu": launch.gpus_per_node},
                                  "requests": {"nvidia.com/gpu": launch.gpus_per_node}},
                    "volumeMounts": [{"name": "placement", "mountPath": MOUNT_DIR, "readOnly": True},
                                     {"name": "dshm", "mountPath": "/dev/shm"}]}],
                    "volumes": [{"name": "placement", "configMap": {"name": f"{name}-placement"}},
                                {"name": "dshm", "emptyDir": {"medium": "Memory"}}]}}

    lws = {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
           "metadata": {"name": name, "labels": {"app": name},
                        "annotations": {"moeplace/memory-plan": memory,
                                        "moeplace/engine": f"{launch.engine} {launch.version}",
                                        "moeplace/layout": launch.layout.lstrip("# ")}},
           "spec": {"replicas": 1, "leaderWorkerTemplate": {
               "size": launch.nodes, "restartPolicy": "RecreateGroupOnPodRestart",
               "leaderTemplate": pod("leader", False), "workerTemplate": pod("worker", True)}}}
    head = [(f"{MARKER} {launch.engine} {launch.version}, {launch.nodes} pod(s) x {launch.gpus_per_node} GPUs "
            "(place export --target k8s; needs the LeaderWorkerSet controller)"), f"# {memory}", *launch.notes,
            launch.layout, f"# image {image}: the engine's published container (--image overrides)"]
    docs = [yaml.safe_dump(d, sort_keys=False, width=120) for d in (configmap, lws)]
    return "\n".join(head) + "\n" + "---\n".join(docs)


def render(target: str, launch: Launch, memory: str, *, name: str, file_name: str, file_bytes: bytes | None,
           image: str | None = None) -> str:
    if target == "shell":
        return shell_script(launch, memory)
    if target == "slurm":
        return slurm_script(launch, memory, k8s_name(name))
    if file_bytes is None:
        raise InputError("--target k8s needs the exported file's bytes")
    return k8s_manifest(launch, memory, name, file_name, file_bytes, image)

