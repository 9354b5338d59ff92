"""Launch commands the released engines accept, and the deployment files written from them.

Every vLLM / SGLang command ``place export --flags`` can print is checked against the option list recorded
from that release's own parser (``moeplace/placement/export/engine_options/*.json``, read here directly,
not through the code under test), and against the live parser when the engine is importable (skipped
otherwise). The Slurm / shell scripts are checked with ``bash -n`` and run with a stand-in engine, the
Kubernetes manifest read with ``yaml.safe_load_all`` (its schemas and sizes: tests/test_export_k8s.py)."""
from __future__ import annotations

import json
import re
import shlex
import subprocess
from importlib import resources
from pathlib import Path

import numpy as np
import pytest
import yaml
from simkit import random_placement as placement

from moeplace.cli.main import main
from moeplace.foundation.errors import InputError
from moeplace.foundation.model import load_model
from moeplace.placement.export import capabilities, deploy
from moeplace.placement.export.engines import (
    VLLM_PRS,
    check_args,
    checked_versions,
    command_argv,
    recommended_eplb_config,
    resolve_version,
)
from moeplace.placement.export.flags import FlagOptions, launch_spec
from moeplace.placement.record import Placement


def recorded(engine: str, version: str) -> dict:
    f = resources.files("moeplace.placement.export").joinpath("engine_options", f"{engine}-{version}.json")
    return json.loads(f.read_text())


@pytest.fixture(scope="module")
def dsv3():
    return load_model("deepseek-v3")


FILE = {"sglang": "loc.json", "vllm-expert-map": "map.json", "vllm-jsonl": "map.jsonl"}
# (format, GPUs, tp, dp, options): one node and two nodes, attention TP and DP, every vLLM mode
CASES = [
    ("sglang", 8, 8, 1, {}), ("sglang", 16, 8, 2, {}), ("sglang", 16, 1, 16, {"online_eplb": True}),
    ("vllm-expert-map", 8, 1, 8, {}), ("vllm-expert-map", 16, 8, 2, {}), ("vllm-jsonl", 16, 1, 16, {}),
    ("vllm-jsonl", 16, 8, 2, {"vllm_static": "round_robin"}), ("vllm-expert-map", 16, 8, 2, {"eplb_interval": 500}),
]


def _all_launches(dsv3, tmp_path):
    for fmt, G, tp, dp, extra in CASES:
        pl = placement(dsv3, G, 32 if G == 16 else 8)
        yield fmt, launch_spec(pl, dsv3, fmt, tmp_path / FILE[fmt], FlagOptions(tp=tp, dp=dp, **extra))


def _options_of(argv):
    return [a.split("=", 1)[0] for a in argv if a.startswith("--")]


def test_every_printed_command_uses_only_recorded_options(dsv3, tmp_path):
    seen = set()
    for fmt, launch in _all_launches(dsv3, tmp_path):
        rec = recorded(launch.engine, launch.version)
        for argv in [launch.argv()] + ([launch.argv(worker=True)] if launch.worker_extra else []):
            for opt in _options_of(argv):
                assert opt in rec["options"], (fmt, opt)
                assert opt not in rec["deprecated"], (fmt, opt)
                seen.add((launch.engine, opt))
            if launch.engine == "vllm" and "--eplb-config" in argv:
                cfg = json.loads(argv[argv.index("--eplb-config") + 1])
                assert set(cfg) <= set(rec["eplb_config_keys"]), cfg  # no open-PR key without --vllm-pr
            for opt, choices in rec["choices"].items():
                if opt in argv:
                    assert argv[argv.index(opt) + 1] in choices, (opt, argv[argv.index(opt) + 1])
    # the cases reach the flags that matter (multi-node vLLM workers, SGLang attention DP)
    assert {("vllm", "--headless"), ("vllm", "--data-parallel-start-rank"), ("sglang", "--attn-dp-size"),
            ("vllm", "--expert-placement-strategy"), ("sglang", "--enable-eplb")} <= seen


def test_sglang_uses_attn_dp_size_not_the_deprecated_flag(dsv3, tmp_path):
    rec = recorded("sglang", "0.5.23")
    assert "--enable-dp-attention" in rec["deprecated"] and "--attn-dp-size" in rec["options"]
    launch = launch_spec(placement(dsv3, 16, 32), dsv3, "sglang", tmp_path / "s.json", FlagOptions(tp=8, dp=2))
    argv = launch.argv()
    assert argv[argv.index("--attn-dp-size") + 1] == "2" and argv[argv.index("--tp-size") + 1] == "16"
    assert "--dp-size" not in argv and "--enable-dp-attention" not in argv


def test_vllm_mainline_runs_online_eplb_and_pr_keys_need_the_opt_in(dsv3, tmp_path):
    pl = placement(dsv3, 16, 32)
    main_line = launch_spec(pl, dsv3, "vllm-jsonl", tmp_path / "m.jsonl", FlagOptions(tp=8, dp=2))
    argv = main_line.argv()
    assert json.loads(argv[argv.index("--eplb-config") + 1]) == recommended_eplb_config(32)
    assert "--vllm-pr 41141" in main_line.text()  # the note names the opt-in
    pr = launch_spec(pl, dsv3, "vllm-jsonl", tmp_path / "m.jsonl", FlagOptions(tp=8, dp=2, vllm_pr=41141))
    argv = pr.argv()
    cfg = json.loads(argv[argv.index("--eplb-config") + 1])
    assert cfg["initial_mapping_path"] == str((tmp_path / "m.jsonl").resolve()) and cfg["disable_online_rebalancing"]
    assert "PR #41141" in pr.text()
    # the released parser rejects exactly those keys: the recorded list says so
    assert check_args("vllm", "0.34.0", argv) == [("vLLM 0.34.0: --eplb-config has no key disable_online_rebalancing, "
                                                  "initial_mapping_path")]
    with pytest.raises(InputError, match="--vllm-pr 49572 loads --format vllm-expert-map"):
        launch_spec(pl, dsv3, "vllm-jsonl", tmp_path / "m.jsonl", FlagOptions(tp=8, dp=2, vllm_pr=49572))
    with pytest.raises(InputError, match="--vllm-pr/--vllm-static choose how vLLM"):
        launch_spec(pl, dsv3, "sglang", tmp_path / "s.json", FlagOptions(tp=8, dp=2, vllm_pr=41141))
    assert set(VLLM_PRS) == {49572, 41141}


def test_check_args_reports_what_the_release_rejects():
    assert check_args("sglang", "0.5.23", ["python", "-m", "sglang.launch_server", "--tp-size", "8"]) == []
    probs = check_args("sglang", "0.5.23", ["--tp-size", "8", "--dp-size", "2", "--enable-dp-attention",
                                             "--moe-a2a-backend", "nccl", "--no-such-flag"])
    assert probs == ["SGLang 0.5.23 marks --enable-dp-attention deprecated",
                     "SGLang 0.5.23: --moe-a2a-backend nccl is not one of its choices",
                     "SGLang 0.5.23 has no option --no-such-flag"]
    assert check_args("vllm", "0.34.0", ["--all2all-backend=deepep_v2", "--data-parallel-address", "$MASTER_ADDR"]) == []


def test_engine_version_defaults_to_the_newest_checked_and_refuses_others():
    assert resolve_version("vllm", None) == checked_versions("vllm")[-1] == "0.34.0"
    assert resolve_version("sglang", "v0.5.23") == "0.5.23"
    with pytest.raises(InputError, match=r"vLLM 0.10.0 was not checked \(checked: 0.34.0"):
        resolve_version("vllm", "0.10.0")


def test_recommended_eplb_config_has_documented_defaults():
    assert recommended_eplb_config(32) == {"window_size": 1000, "step_interval": 3000, "num_redundant_experts": 32,
                                           "use_async": True}
    assert recommended_eplb_config(0, window_size=200, step_interval=600)["step_interval"] == 600
    with pytest.raises(InputError):
        recommended_eplb_config(-1)


# ----------------------------------------------------------------------- the engines' own parsers
def _expand(argv, rank=1):
    """The words a shell would pass on node ``rank`` (MASTER_ADDR a literal address)."""
    out = []
    for a in argv:
        a = re.sub(r"\$\(\(NODE_RANK\*(\d+)\)\)", lambda m: str(rank * int(m.group(1))), a)
        out.append(a.replace("$NODE_RANK", str(rank)).replace("$MASTER_ADDR", "10.0.0.1"))
    return out


def test_vllm_own_parser_accepts_the_printed_commands(dsv3, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cpu")  # the parser builds a DeviceConfig; no GPU here
    cli_args = pytest.importorskip("vllm.entrypoints.common.cli_args")
    import vllm
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    if vllm.__version__ not in checked_versions("vllm"):
        pytest.skip(f"vllm {vllm.__version__} is not a checked release")
    parser = cli_args.make_arg_parser(FlexibleArgumentParser())
    n = 0
    for _, launch in _all_launches(dsv3, tmp_path):
        if launch.engine != "vllm":
            continue
        for argv in [launch.argv()] + ([launch.argv(worker=True)] if launch.worker_extra else []):
            args = parser.parse_args(_expand(argv)[2:])  # after `vllm serve`
            engine_args = EngineArgs.from_cli_args(args)
            assert engine_args.enable_expert_parallel
            n += 1
    assert n >= 5
    # the K3 command that switches the load-time relabelling on (its environment is not an argument)
    k3 = load_model("kimi-k3")
    plugin = launch_spec(placement(k3, 32, 0), k3, "vllm-expert-map", tmp_path / "k3.json",
                         FlagOptions(tp=8, dp=4, placement_path=str(tmp_path / "p.json")))
    assert plugin.env and plugin.argv()[:2] == ["vllm", "serve"]
    for argv in (plugin.argv(), plugin.argv(worker=True)):
        engine_args = EngineArgs.from_cli_args(parser.parse_args(_expand(argv)[2:]))
        assert engine_args.enable_expert_parallel and not engine_args.enable_eplb
    # and it rejects the open PR's keys, which is why they sit behind --vllm-pr
    pr = launch_spec(placement(dsv3, 16, 32), dsv3, "vllm-jsonl", tmp_path / "m.jsonl",
                     FlagOptions(tp=8, dp=2, vllm_pr=41141))
    capsys.readouterr()
    with pytest.raises(SystemExit):  # argparse exits 2, as `vllm serve` does
        EngineArgs.from_cli_args(parser.parse_args(_expand(pr.argv())[2:]))
    assert "initial_mapping_path" in capsys.readouterr().err


def test_sglang_own_parser_accepts_the_printed_commands(dsv3, tmp_path):
    server_args = pytest.importorskip("sglang.srt.server_args")
    import argparse
    from importlib.metadata import version

    if version("sglang") not in checked_versions("sglang"):
        pytest.skip(f"sglang {version('sglang')} is not a checked release")
    n = 0
    for _, launch in _all_launches(dsv3, tmp_path):
        if launch.engine != "sglang":
            continue
        parser = argparse.ArgumentParser()
        server_args.ServerArgs.add_cli_args(parser)
        args = parser.parse_args(_expand(launch.argv())[3:])  # after `python -m sglang.launch_server`
        sa = server_args.ServerArgs.from_cli_args(args)
        assert sa.ep_size == launch.nodes * launch.gpus_per_node and not sa.enable_dp_attention
        n += 1
    assert n == 3


def _pool_launches(tmp_path, fmt):
    """Each pool's launch of a K3 deployment (TEP8 prefill -> DEP16 decode on GB300, and the H200 variant
    TP8 x DP2 prefill -> TP8 x DP4 decode) exported in ``fmt``, as ``place export --pools --flags`` builds it."""
    k3 = load_model("kimi-k3")
    for gpu, pools in (("gb300-nvl72", ((8, 8, 1, 256), (16, 1, 16, 64))), ("h200", ((16, 8, 2, 256), (32, 8, 4, 16)))):
        for role, (G, tp, dp, batch) in zip(("prefill", "decode"), pools):
            pl = placement(k3, G, 0, gpus_per_node=min(G, 72 if gpu.startswith("gb") else 8))
            yield role, launch_spec(pl, k3, fmt, tmp_path / f"{role}.json", FlagOptions(
                tp=tp, dp=dp, gpu=gpu, pool=role, max_seqs=batch, max_batched_tokens=8192,
                model_path=f"/ckpt/k3-{role}", placement_path=str(tmp_path / f"{role}-placement.json")))


def test_vllm_own_parser_accepts_the_pool_commands(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cpu")
    cli_args = pytest.importorskip("vllm.entrypoints.common.cli_args")
    import vllm
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    if vllm.__version__ not in checked_versions("vllm"):
        pytest.skip(f"vllm {vllm.__version__} is not a checked release")
    parser = cli_args.make_arg_parser(FlexibleArgumentParser())
    n = 0
    for role, launch in _pool_launches(tmp_path, "vllm-expert-map"):
        for argv in [launch.argv()] + ([launch.argv(worker=True)] if launch.worker_extra else []):
            args = parser.parse_args(_expand(argv)[2:])
            ea = EngineArgs.from_cli_args(args)
            assert ea.enable_expert_parallel and ea.kv_transfer_config.kv_connector == "NixlConnector"
            assert ea.kv_transfer_config.kv_role == "kv_both" and args.model_tag == f"/ckpt/k3-{role}"
            assert ea.max_num_seqs == (256 if role == "prefill" else launch_seqs(launch))
            n += 1
    assert n >= 4


def launch_seqs(launch):
    argv = launch.argv()
    return int(argv[argv.index("--max-num-seqs") + 1])


def test_sglang_own_parser_accepts_the_pool_commands(tmp_path):
    server_args = pytest.importorskip("sglang.srt.server_args")
    import argparse
    from importlib.metadata import PackageNotFoundError, version

    try:
        v = version("sglang")
    except PackageNotFoundError:  # the wheel's source on the path (unpacked), not installed
        from sglang.version import __version__ as v
    if v not in checked_versions("sglang"):
        pytest.skip(f"sglang {v} is not a checked release")
    n = 0
    for role, launch in _pool_launches(tmp_path, "sglang"):
        parser = argparse.ArgumentParser()
        server_args.ServerArgs.add_cli_args(parser)
        args = parser.parse_args(_expand(launch.argv())[3:])
        sa = server_args.ServerArgs.from_cli_args(args)
        assert sa.disaggregation_mode == role and sa.disaggregation_transfer_backend == "nixl"
        assert sa.model_path == f"/ckpt/k3-{role}" and sa.ep_size == launch.nodes * launch.gpus_per_node
        n += 1
    assert n == 4


# ----------------------------------------------------------------------- deployment files
def _export(tmp_path, pj, fmt, target, *extra):
    out = tmp_path / FILE[fmt]
    launch_out = tmp_path / f"launch-{fmt}{deploy.default_suffix(target)}"
    assert main(["export", str(pj), "--format", fmt, "--out", str(out), "--flags", "--tp", "8", "--dp", "2",
                 "--target", target, "--launch-out", str(launch_out), *extra]) == 0
    return out, launch_out


@pytest.fixture(scope="module")
def pj(tmp_path_factory, dsv3):
    p = tmp_path_factory.mktemp("pl") / "pl.json"
    placement(dsv3, 16, 32).save(p)
    return p


@pytest.mark.parametrize("fmt", ["sglang", "vllm-expert-map"])
def test_slurm_and_shell_scripts_parse_and_start_every_node(tmp_path, pj, fmt, capsys):
    out, sbatch = _export(tmp_path, pj, fmt, "slurm")
    text = sbatch.read_text()
    subprocess.run(["bash", "-n", str(sbatch)], check=True)
    assert "#SBATCH --nodes=2" in text and "srun --nodes=2 --ntasks-per-node=1" in text
    assert "fits" in text.splitlines()[2]  # the memory plan's verdict
    assert re.search(r"^#SBATCH", text, re.MULTILINE).start() < text.index("set -euo")  # sbatch reads headers first
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST"' in text and "MASTER_ADDR=${HOSTS[0]}" in text
    if fmt == "sglang":
        assert f"--init-expert-location {out.resolve()}" in text and "--node-rank $NODE_RANK" in text
    else:
        assert "--headless" in text and "--vllm-pr 49572" in text
    _, sh = _export(tmp_path, pj, fmt, "shell", "--force")
    subprocess.run(["bash", "-n", str(sh)], check=True)
    assert sh.stat().st_mode & 0o100
    # a rerun replaces its own file; a file it did not write is refused
    foreign = tmp_path / "mine.sh"
    foreign.write_text("#!/bin/sh\necho mine\n")
    capsys.readouterr()
    assert main(["export", str(pj), "--format", fmt, "--out", str(out), "--force", "--flags", "--tp", "8",
                 "--dp", "2", "--target", "shell", "--launch-out", str(foreign)]) != 0
    assert foreign.read_text() == "#!/bin/sh\necho mine\n"


def test_k8s_manifest_mounts_the_file_where_the_command_reads_it(tmp_path, pj, dsv3):
    out, manifest = _export(tmp_path, pj, "sglang", "k8s")
    cm, lws, _ = list(yaml.safe_load_all(manifest.read_text()))
    assert cm["kind"] == "ConfigMap" and cm["data"]["loc.json"] == out.read_text()
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1" and lws["kind"] == "LeaderWorkerSet"
    spec = lws["spec"]["leaderWorkerTemplate"]
    assert spec["size"] == 2 and "fits" in lws["metadata"]["annotations"]["moeplace/memory-plan"]
    for role in ("leaderTemplate", "workerTemplate"):
        pod = spec[role]["spec"]
        c = pod["containers"][0]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 8
        mount = next(m for m in c["volumeMounts"] if m["name"] == "placement")
        vol = next(v for v in pod["volumes"] if v["name"] == "placement")
        assert vol["configMap"]["name"] == cm["metadata"]["name"]
        words = shlex.split(c["args"][0].splitlines()[1])
        path = words[words.index("--init-expert-location") + 1]
        assert Path(path).parent == Path(mount["mountPath"]) and Path(path).name in cm["data"]
        assert "LWS_LEADER_ADDRESS" in c["args"][0]
    # vLLM: the workers run headless
    _, vm = _export(tmp_path, pj, "vllm-expert-map", "k8s", "--vllm-pr", "49572")
    _, lws, _ = list(yaml.safe_load_all(vm.read_text()))
    worker = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["args"][0]
    assert "--headless" in worker and "initial_expert_map_path" in worker and "/etc/moeplace/map.json" in worker
    # what the worker pod's container runs: node 1 of the group, the leader's address from LeaderWorkerSet
    import os

    env = {**os.environ, "PATH": f"{_fake_bin(tmp_path)}:{os.environ['PATH']}", "LWS_WORKER_INDEX": "1",
           "LWS_LEADER_ADDRESS": "moeplace-deepseek-v3-vllm-0.moeplace-deepseek-v3-vllm"}
    got = subprocess.run(["bash", "-c", worker], env=env, capture_output=True, text=True, check=True).stdout.split()
    assert got[got.index("--data-parallel-address") + 1] == "moeplace-deepseek-v3-vllm-0.moeplace-deepseek-v3-vllm"
    assert got[-3:] == ["--headless", "--data-parallel-start-rank", "1"]
    cfg = json.loads(got[got.index("--eplb-config") + 1])
    assert cfg["initial_expert_map_path"] == "/etc/moeplace/map.json"


def test_target_needs_an_engine_it_knows_and_flags(tmp_path, pj, capsys):
    assert main(["export", str(pj), "--format", "trtllm", "--out", str(tmp_path / "t.yaml"), "--flags",
                 "--dp", "16", "--target", "slurm"]) == 2
    assert "SGLang and vLLM formats" in capsys.readouterr().err and not (tmp_path / "t.yaml").exists()
    assert main(["export", str(pj), "--format", "sglang", "--out", str(tmp_path / "s.json"), "--target", "k8s"]) == 2
    assert "add --flags" in capsys.readouterr().err
    assert main(["export", str(pj), "--format", "sglang", "--out", str(tmp_path / "s.json"), "--flags", "--tp", "8",
                 "--engine-version", "0.4.0"]) == 2
    assert "SGLang 0.4.0 was not checked" in capsys.readouterr().err


def test_export_json_lists_files_warnings_and_launch_arguments(tmp_path, pj, capsys):
    out = tmp_path / "s.json"
    capsys.readouterr()
    assert main(["export", str(pj), "--format", "sglang", "--out", str(out), "--flags", "--tp", "8", "--dp", "2",
                 "--target", "slurm", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["wrote"] == [str(out), str(tmp_path / "s.sbatch")]
    assert doc["launch"]["engine"] == "sglang" and doc["launch"]["engine_version"] == "0.5.23"
    argv = doc["launch"]["argv"]
    assert argv[argv.index("--init-expert-location") + 1] == str(out.resolve())
    assert doc["memory_plan"]["fits"] and doc["launch"]["nodes"] == 2 and isinstance(doc["warnings"], list)


def _fake_bin(tmp_path: Path) -> Path:
    """``vllm`` / ``python`` that print their arguments, ``scontrol`` that names two hosts, ``srun`` that
    runs its command as node 1 -- enough to run the written scripts here."""
    b = tmp_path / "bin"
    b.mkdir()
    for name in ("vllm", "python"):
        (b / name).write_text('#!/bin/bash\nprintf "%s\\n" "$@"\n')
    (b / "scontrol").write_text('#!/bin/bash\nprintf "node-a\\nnode-b\\n"\n')
    (b / "srun").write_text('#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nSLURM_NODEID=1 exec "$@"\n')
    for f in b.iterdir():
        f.chmod(0o755)
    return b


@pytest.mark.parametrize("env,message", [
    ({}, "set NODE_RANK to this node's index, 0..1"),
    ({"NODE_RANK": "1"}, "set MASTER_ADDR to the head node address"),  # was swallowed by an apostrophe
    ({"NODE_RANK": "2", "MASTER_ADDR": "node-a"}, "set NODE_RANK to this node's index, 0..1"),
    ({"NODE_RANK": "x; rm -rf /", "MASTER_ADDR": "node-a"}, "set NODE_RANK to this node's index, 0..1"),
])
def test_shell_script_refuses_to_start_without_node_rank_and_master_addr(tmp_path, pj, env, message):
    """The checks run, in a fake PATH where the engine only prints: nothing starts, one line, exit 2."""
    import os

    _, script = _export(tmp_path, pj, "vllm-expert-map", "shell")
    subprocess.run(["bash", "-n", str(script)], check=True)
    base = {k: v for k, v in os.environ.items() if k not in ("NODE_RANK", "MASTER_ADDR")}
    p = subprocess.run(["bash", str(script)], env={**base, "PATH": f"{_fake_bin(tmp_path)}:{os.environ['PATH']}", **env},
                       capture_output=True, text=True, check=False)
    assert (p.returncode, p.stdout, p.stderr) == (2, "", f"launch: {message}\n")


@pytest.mark.parametrize("target", ["shell", "slurm"])
def test_scripts_start_node_1_with_the_worker_command(tmp_path, pj, target, dsv3):
    import os

    _, script = _export(tmp_path, pj, "vllm-expert-map", target)
    env = {**os.environ, "PATH": f"{_fake_bin(tmp_path)}:{os.environ['PATH']}"}
    # shell: the user sets both; slurm: sbatch sets the node list, the script finds the head in it
    env.update({"NODE_RANK": "1", "MASTER_ADDR": "node-a"} if target == "shell" else {"SLURM_JOB_NODELIST": "node-[a-b]"})
    p = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, check=True)
    got = p.stdout.splitlines()
    want = launch_spec(placement(dsv3, 16, 32), dsv3, "vllm-expert-map", tmp_path / "map.json",
                       FlagOptions(tp=8, dp=2)).argv(worker=True)
    assert got == [a.replace("$MASTER_ADDR", "node-a").replace("$((NODE_RANK*1))", "1") for a in want[1:]]
    assert got[got.index("--data-parallel-address") + 1] == "node-a" and got[-2:] == ["--data-parallel-start-rank", "1"]


def test_format_options_are_the_layout_keys_of_the_trtllm_yaml_only():
    """The one place export and the dashboard get a format's layout options: TensorRT-LLM's YAML keys for
    --format trtllm; the same layout check for trtllm-lb, no keys; nothing for the other targets."""
    from moeplace.placement.export.flags import format_options

    model = load_model("qwen3-30b-a3b")
    pl = Placement.from_phy2log(np.tile(np.arange(model.num_experts), (model.num_moe_layers, 1)), model, 8, 8)
    opts = FlagOptions(tp=1, dp=8)
    assert format_options(pl, "trtllm", opts) == {"attention_dp": True, "moe_backend": "WIDEEP",
                                                  "kv_cache_dtype": "fp8"}
    assert format_options(pl, "trtllm-lb", opts) == {}
    assert format_options(pl, "sglang", opts) == {} and format_options(pl, "vllm-jsonl", opts) == {}
    with pytest.raises(InputError, match="cannot be expressed"):
        format_options(pl, "trtllm-lb", FlagOptions(tp=2, dp=4))
    with pytest.raises(InputError, match="--format 'nosuch' unknown"):
        format_options(pl, "nosuch", opts)


# ----------------------------------------------------------------------- Kimi K3: what each engine lacks
def _check_recorded(argv: list[str], engine: str = "vllm", version: str = "0.34.0") -> None:
    """``argv`` against the recorded option table, read here directly (options, choices, EPLB keys)."""
    rec = recorded(engine, version)
    i = next(k for k, a in enumerate(argv) if a.startswith("--"))
    for k in range(i, len(argv)):
        a = argv[k]
        if a.startswith("--"):
            assert a in rec["options"] and a not in rec["deprecated"], a
            if a in rec["choices"]:
                assert argv[k + 1] in rec["choices"][a], (a, argv[k + 1])
            if a == "--eplb-config":
                assert set(json.loads(argv[k + 1])) <= set(rec["eplb_config_keys"])
        else:
            assert argv[k - 1] in rec["takes_value"], a  # a value, never a stray word


def test_k3_vllm_command_switches_the_load_time_relabelling_on(tmp_path, capsys):
    k3 = load_model("kimi-k3")
    pj = tmp_path / "k3.json"
    placement(k3, 32, 0).save(pj)
    capsys.readouterr()
    assert main(["export", str(pj), "--format", "vllm-expert-map", "--out", str(tmp_path / "map.json"), "--flags",
                 "--tp", "8", "--dp", "4", "--json"]) == 0
    launch = json.loads(capsys.readouterr().out)["launch"]
    assert launch["env"] == {"MOEPLACE_PLACEMENT": str(pj.resolve()),
                             "VLLM_RAY_EXTRA_ENV_VARS_TO_COPY": "MOEPLACE_PLACEMENT"} and launch["applies_placement"]
    assert launch["engine_version"] == "0.34.0"
    for argv in (launch["argv"], launch["worker_argv"]):
        assert argv[:2] == ["vllm", "serve"] and "--enable-expert-parallel" in argv
        assert "--enable-eplb" not in argv  # EPLB wires no K3 layer in 0.34.0: not printed
        _check_recorded(_expand(argv))
    notes = " ".join(launch["notes"])
    assert "pip install 'moeplace[vllm]'" in notes and "MOEPLACE_PLACEMENT" in notes
    assert "loads no expert map" in notes and "#49572" in notes
    # the printed text sets the variable on the command itself, and still parses as one command
    (words,) = command_argv(launch["command"])
    assert words[0] == f"MOEPLACE_PLACEMENT={pj.resolve()}" and words[2:] == launch["argv"]
    assert words[1] == "VLLM_RAY_EXTRA_ENV_VARS_TO_COPY=MOEPLACE_PLACEMENT"  # Ray DP actors get it too


def test_k3_placement_with_replicas_says_what_each_engine_lacks(tmp_path):
    k3 = load_model("kimi-k3")
    pl = placement(k3, 32, 32)
    opts = FlagOptions(tp=8, dp=4, placement_path=str(tmp_path / "k3.json"))
    vl = launch_spec(pl, k3, "vllm-expert-map", tmp_path / "m.json", opts)
    assert not vl.applies_placement and not vl.env and "--enable-eplb" not in vl.argv()
    text = vl.text()
    assert "does not wire K3 into EPLB" in text and "#50647" in text and "--redundant 0" in text
    assert "MOEPLACE_PLACEMENT" in text and "--format checkpoint" in text
    _check_recorded(_expand(vl.argv()))
    sg = launch_spec(pl, k3, "sglang", tmp_path / "s.json", opts)
    assert not sg.applies_placement
    assert "kimi_k3.py lacks get_model_config_for_expert_location" in sg.text() and "--format checkpoint" in sg.text()
    _check_recorded(_expand(sg.argv()), "sglang", "0.5.23")
    # the capability table says the same thing the commands say
    assert capabilities.cell("vllm", "online_eplb", k3).supported is False
    assert capabilities.cell("sglang", "placement_file", k3).supported is False
    assert capabilities.cell("trtllm", "placement_file", k3).supported is False
    assert capabilities.cell("vllm", "plugin", k3).supported and capabilities.cell("sglang", "checkpoint", k3).supported


def test_vllm_tp_spanning_nodes_uses_the_multi_node_launcher_not_dp_ranks(dsv3, tmp_path):
    pl = placement(dsv3, 32, 32)
    lw = launch_spec(pl, dsv3, "vllm-expert-map", tmp_path / "m.json", FlagOptions(tp=32, dp=1))
    head, worker = lw.argv(), lw.argv(worker=True)
    assert "--data-parallel-start-rank" not in worker and "--data-parallel-size" not in head
    assert head[head.index("--nnodes") + 1] == "4" and head[head.index("--node-rank") + 1] == "$NODE_RANK"
    assert worker[-1] == "--headless"
    _check_recorded(_expand(head))
    _check_recorded(_expand(worker))
    # DP ranks within nodes: node n starts at DP rank n * ranks-per-node, and the ranks add up to the DP size
    lw = launch_spec(pl, dsv3, "vllm-expert-map", tmp_path / "m.json", FlagOptions(tp=8, dp=4))
    for rank in range(1, 4):
        w = _expand(lw.argv(worker=True), rank)
        assert int(w[w.index("--data-parallel-start-rank") + 1]) == rank
        assert int(w[w.index("--data-parallel-size-local") + 1]) * 4 == int(w[w.index("--data-parallel-size") + 1])
    with pytest.raises(InputError, match="spans 2 hosts"):
        launch_spec(pl, dsv3, "vllm-expert-map", tmp_path / "m.json", FlagOptions(tp=16, dp=2))


def test_plugin_launch_files_export_the_switch_and_k8s_refuses_it(tmp_path, capsys):
    k3 = load_model("kimi-k3")
    pj = tmp_path / "k3.json"
    placement(k3, 32, 0).save(pj)
    script = tmp_path / "run.sh"
    assert main(["export", str(pj), "--format", "vllm-expert-map", "--out", str(tmp_path / "map.json"), "--flags",
                 "--tp", "8", "--dp", "4", "--target", "shell", "--launch-out", str(script)]) == 0
    assert f"export MOEPLACE_PLACEMENT={pj.resolve()}" in script.read_text()
    subprocess.run(["bash", "-n", str(script)], check=True)
    capsys.readouterr()
    assert main(["export", str(pj), "--format", "vllm-expert-map", "--out", str(tmp_path / "m2.json"), "--flags",
                 "--tp", "8", "--dp", "4", "--target", "k8s"]) == 2
    assert "does not mount" in capsys.readouterr().err and not (tmp_path / "m2.json").exists()
