"""Hostile values in launch files (``place export --flags --target shell|slurm|k8s``): nothing a user passes
(or a file the command reads holds) reaches a shell or a manifest unquoted.

Every target is written with values a shell or YAML would act on if they were pasted in unquoted (command
substitutions, quotes, ``;``, ``#``, YAML indicators), then checked three ways: ``bash -n`` parses it, a dry
run with stand-in commands on ``PATH`` (``vllm``, ``python``, ``sglang``, ``srun``, ``scontrol`` that print
their arguments, and ``touch`` that records being called) shows that nothing ran but the engine, with each
hostile value arriving as ONE argument, byte for byte; the Slurm header is read as sbatch reads it (every
``#SBATCH`` line before the first command survives) and the Kubernetes manifest with ``yaml.safe_load_all``
(every object and value survives). A value that no launch file can carry (a line break, any control
character) is refused with one line before anything is written."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml
from fuzzkit import assert_refused, assert_untouched, run_place, snapshot
from simkit import random_placement

from moeplace.foundation.model import load_model
from moeplace.placement.export import deploy

ROOT = Path(__file__).resolve().parents[1]
# a file name a shell would run pieces of, unquoted: substitutions, a quote, ';', '#', globs, braces, '&'
EVIL_NAME = "a b'$(touch M1)`touch M2`;touch M3 #&|*?{x,y}\"\\ -- --help.json"
EVIL_MODEL = "m'; touch M4 #\"$(touch M5)`touch M6`: - &a *a !t {[%@"
EVIL_HOST = "/w: {a: b} #$(touch M7) 'x' - [y]"
SBATCH = ["--job-name=moeplace-deepseek-v3-{engine}", "--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=8",
          "--exclusive"]


@pytest.fixture(scope="module")
def dsv3():
    return load_model("deepseek-v3")


@pytest.fixture(scope="module")
def plans(tmp_path_factory, dsv3):
    """A placement with replicas (SGLang file, vLLM online EPLB) and a replica-free one (the vLLM plugin,
    whose environment carries the placement path), each at a path a shell would act on."""
    d = tmp_path_factory.mktemp("evil") / "dir $(touch M0)"
    d.mkdir()
    random_placement(dsv3, 16, 32).save(d / "with replicas.json")
    random_placement(dsv3, 16, 0).save(d / EVIL_NAME)
    return d


def _fake_bin(root: Path) -> Path:
    """Stand-ins: the engines print their arguments one per line (and write MOEPLACE_PLACEMENT to ENV);
    ``touch`` records that something called it (the markers must never appear); ``scontrol`` names two
    hosts; ``srun`` runs its command as node 1."""
    b = root / "bin"
    b.mkdir(exist_ok=True)
    for name in ("vllm", "python", "sglang"):
        (b / name).write_text('#!/bin/bash\nprintf "%s\\n" "$@"\n'
                              f'printf %s "${{MOEPLACE_PLACEMENT-}}" > {shlex.quote(str(root / "ENV"))}\n')
    (b / "touch").write_text(f'#!/bin/bash\necho "$@" >> {shlex.quote(str(root / "TOUCHED"))}\n')
    (b / "scontrol").write_text('#!/bin/bash\nprintf "node-a\\nnode-b\\n"\n')
    (b / "srun").write_text('#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nSLURM_NODEID=1 exec "$@"\n')
    for f in b.iterdir():
        f.chmod(0o755)
    return b


def _nothing_ran(root: Path, *dirs: Path) -> None:
    assert not (root / "TOUCHED").exists(), (root / "TOUCHED").read_text()
    for d in (root, *dirs):
        made = [p.name for p in d.iterdir() if p.name.startswith("M") and len(p.name) == 2]
        assert not made, made


def _sbatch_lines(text: str) -> list[str]:
    """The ``#SBATCH`` options sbatch reads: those before the first line that is neither blank nor a comment."""
    out = []
    for line in text.splitlines()[1:]:
        if line.strip() and not line.startswith("#"):
            break
        if line.startswith("#SBATCH"):
            out.append(line[len("#SBATCH "):])
    return out


def _export(capsys, placement: Path, out: Path, fmt: str, target: str, *extra: str):
    launch_out = out.parent / f"launch{deploy.default_suffix(target)}"
    res = run_place(["export", placement, "--format", fmt, "--out", out, "--flags", "--tp", "8", "--dp", "2",
                     "--target", target, "--launch-out", launch_out, "--model-path", EVIL_MODEL, *extra], capsys)
    assert res.rc == 0, res.err
    return launch_out


CASES = [("sglang", "with replicas.json", "--init-expert-location", "sglang"),
         ("vllm-expert-map", EVIL_NAME, None, "vllm")]  # the plugin: MOEPLACE_PLACEMENT is the evil path


@pytest.mark.parametrize("fmt,placement,path_flag,engine", CASES)
@pytest.mark.parametrize("target", ["shell", "slurm"])
def test_shell_and_slurm_scripts_quote_every_hostile_value(tmp_path, plans, capsys, fmt, placement, path_flag,
                                                           engine, target):
    out = tmp_path / (EVIL_NAME if fmt == "sglang" else "map.json")
    script = _export(capsys, plans / placement, out, fmt, target)
    text = script.read_text()
    subprocess.run(["bash", "-n", str(script)], check=True)
    if target == "slurm":
        assert _sbatch_lines(text) == [s.format(engine=engine) for s in SBATCH]
    env = {**os.environ, "PATH": f"{_fake_bin(tmp_path)}:{os.environ['PATH']}", "NODE_RANK": "1",
           "MASTER_ADDR": "node-a", "SLURM_JOB_NODELIST": "node-[a-b]"}
    run = subprocess.run(["bash", str(script)], env=env, cwd=tmp_path, capture_output=True, text=True,
                         check=True)
    _nothing_ran(tmp_path, plans, Path.cwd())
    argv = run.stdout.splitlines()
    model_flag = "--model-path" if engine == "sglang" else "serve"
    assert argv[argv.index(model_flag) + 1] == EVIL_MODEL
    if path_flag:
        assert argv[argv.index(path_flag) + 1] == str(out.resolve())
    else:  # the plugin's switch: the placement JSON's path, exported for the engine
        assert (tmp_path / "ENV").read_text() == str((plans / placement).resolve())


def test_k8s_manifest_keeps_every_object_and_value(tmp_path, plans, capsys):
    out = tmp_path / "loc.json"
    manifest = _export(capsys, plans / "with replicas.json", out, "sglang", "k8s", "--k8s-weights",
                       f"host:{EVIL_HOST}", "--k8s-weights-mount", "/models #$(touch M8) x - [y]")
    docs = list(yaml.safe_load_all(manifest.read_text()))
    assert [d["kind"] for d in docs] == ["ConfigMap", "LeaderWorkerSet", "Service"]
    lws = docs[1]
    for role in ("leaderTemplate", "workerTemplate"):
        pod = lws["spec"]["leaderWorkerTemplate"][role]["spec"]
        weights = next(v for v in pod["volumes"] if v["name"] == "weights")
        assert weights["hostPath"]["path"] == EVIL_HOST
        c = pod["containers"][0]
        assert next(m for m in c["volumeMounts"] if m["name"] == "weights")["mountPath"] == "/models #$(touch M8) x - [y]"
        env = {**os.environ, "PATH": f"{_fake_bin(tmp_path)}:{os.environ['PATH']}", "LWS_WORKER_INDEX": "1",
               "LWS_LEADER_ADDRESS": "leader"}
        got = subprocess.run(["bash", "-c", c["args"][0]], env=env, cwd=tmp_path, capture_output=True, text=True,
                             check=True).stdout.splitlines()
        assert got[got.index("--model-path") + 1] == EVIL_MODEL
        assert got[got.index("--init-expert-location") + 1] == f"{deploy.MOUNT_DIR}/loc.json"
    _nothing_ran(tmp_path, plans)


# ----------------------------------------------------------------------- values no launch file can carry
BREAKS = ["\n", "\r", "\x1b[2K", "\x00"[:0] + "\x7f", "\u2028", "\x85"]


@pytest.mark.parametrize("brk", BREAKS)
@pytest.mark.parametrize("target", ["shell", "slurm", "k8s"])
def test_a_line_break_in_any_value_is_refused_before_anything_is_written(tmp_path, plans, capsys, brk, target):
    w = tmp_path / "w"
    w.mkdir()
    pl = w / "p.json"
    pl.write_bytes((plans / "with replicas.json").read_bytes())
    base = ["export", pl, "--format", "sglang", "--flags", "--tp", "8", "--dp", "2", "--target", target]
    cases = [
        (["--out", w / f"x{brk}#SBATCH --nodes=99{brk}touch M9.json"], "--out"),
        (["--out", w / "x.json", "--model-path", f"m{brk}touch M9"], "--model-path"),
    ]
    if target == "k8s":
        cases += [(["--out", w / "x.json", "--image", f"img{brk}kind: Pod"], "--image"),
                  (["--out", w / "x.json", "--k8s-weights", f"host:/w{brk}x: y"], "--k8s-weights"),
                  (["--out", w / "x.json", "--k8s-weights-mount", f"/m{brk}x"], "--k8s-weights-mount")]
    for extra, flag in cases:
        before = snapshot(w)
        line = assert_refused(run_place([*base, *extra], capsys), flag)
        assert "control character" in line, line
        assert_untouched(w, before)


def test_plugin_placement_path_with_a_line_break_is_refused(tmp_path, plans, capsys):
    pl = tmp_path / "p\n#SBATCH --nodes=99\ntouch M9.json"
    pl.write_bytes((plans / EVIL_NAME).read_bytes())
    before = snapshot(tmp_path)
    line = assert_refused(run_place(["export", pl, "--format", "vllm-expert-map", "--out", tmp_path / "m.json",
                                     "--flags", "--tp", "8", "--dp", "2", "--target", "slurm"], capsys),
                          "MOEPLACE_PLACEMENT")
    assert "control character" in line
    assert_untouched(tmp_path, before)


@pytest.mark.parametrize("image", ["Repo/x", "x y", "x:tag with space", "-x", "x@sha256:zz", "x: {a: b}"])
def test_k8s_image_must_be_an_image_reference(tmp_path, plans, capsys, image):
    res = run_place(["export", plans / "with replicas.json", "--format", "sglang", "--out", tmp_path / "x.json",
                     "--flags", "--tp", "8", "--dp", "2", "--target", "k8s", f"--image={image}"], capsys)
    assert "not a container image reference" in assert_refused(res, "--image")
    assert not list(tmp_path.iterdir())


def test_k8s_file_name_must_be_a_configmap_key(tmp_path, plans, capsys):
    res = run_place(["export", plans / "with replicas.json", "--format", "sglang", "--out", tmp_path / "a b.json",
                     "--flags", "--tp", "8", "--dp", "2", "--target", "k8s"], capsys)
    assert "ConfigMap" in assert_refused(res, "--out")
    assert not list(tmp_path.iterdir())


def test_values_from_files_become_one_comment_line(tmp_path, plans, capsys, dsv3):
    """A GPU spec whose name holds a line break (a file the command reads, not a flag): the memory line in
    the header is one escaped comment; nothing runs and every #SBATCH line survives."""
    spec = json.loads((ROOT / "moeplace/foundation/presets/gpus.json").read_text())["h200"]
    spec["name"] = "h200\n#SBATCH --nodes=99\ntouch M9"
    gpu = tmp_path / "gpu.json"
    gpu.write_text(json.dumps(spec))
    script = _export(capsys, plans / "with replicas.json", tmp_path / "loc.json", "sglang", "slurm", "--gpu",
                     str(gpu))
    text = script.read_text()
    subprocess.run(["bash", "-n", str(script)], check=True)
    assert _sbatch_lines(text) == [s.format(engine="sglang") for s in SBATCH]
    assert "h200\\n#SBATCH --nodes=99\\ntouch M9" in text
    env = {**os.environ, "PATH": f"{_fake_bin(tmp_path)}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node-[a-b]"}
    subprocess.run(["bash", str(script)], env=env, cwd=tmp_path, capture_output=True, check=True)
    _nothing_ran(tmp_path)


def test_comment_and_k8s_name_helpers():
    assert deploy.comment("a\nb\u2028c\x1b") == "# a\\nb\\u2028c\\x1b"
    assert deploy.comment("# x") == "# x"
    assert deploy.k8s_name("3b; rm -rf /\n") == "m-3b-rm--rf"
    assert deploy.k8s_name("") == "moeplace"
    assert deploy.check_image("registry.example.com:5000/team/vllm-openai:v0.34.0@sha256:" + "a" * 64)
