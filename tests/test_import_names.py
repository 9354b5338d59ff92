"""One namespace (docs/design.md "Decisions"): the wheel installs ``moeplace`` and nothing else at the top
of site-packages, so moeplace sits beside distributions whose import names are generic (Hugging Face's
``kernels``, which transformers probes for with ``importlib.util.find_spec("kernels")``; PyPI's
``traces``)."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_the_wheel_has_one_top_level_package(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "moeplace", src / "moeplace", ignore=shutil.ignore_patterns("__pycache__"))
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                          "--disable-pip-version-check", "-w", str(tmp_path / "dist"), str(src)],
                         check=False, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("moeplace-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/", 1)[0] for n in names if not n.split("/", 1)[0].endswith(".dist-info")}
    assert top == {"moeplace"}, top
    # the package data every stage reads at run time travels with it
    # (every data file in the package: a new one missing from [tool.setuptools.package-data] fails here)
    shipped = sorted(str(f.relative_to(REPO)) for f in (REPO / "moeplace").rglob("*")
                     if f.is_file() and f.suffix in (".json", ".sh", ".yaml"))
    assert "moeplace/sim/cost_ensemble.json" in shipped and "moeplace/foundation/presets/gpus.json" in shipped
    for data in shipped:
        assert data in names, data
    assert any(n.startswith("moeplace/foundation/presets/models/") and n.endswith(".json") for n in names)
    # the vLLM load-time plugin is declared where vLLM's load_general_plugins looks for it
    (ep,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(ep).decode()
    group = text.split("[vllm.general_plugins]", 1)[1].split("[", 1)[0]
    assert "moeplace = moeplace.placement.export.vllm_plugin:register" in group, text
    (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
    assert "Provides-Extra: vllm" in zipfile.ZipFile(wheel).read(meta).decode()


def test_installed_moeplace_claims_only_its_own_name():
    """What this environment installed (editable here) maps one import name to the moeplace distribution,
    and the generic names answer to their own distributions where installed (transformers 5 pulls in
    Hugging Face's ``kernels``), never to our source tree."""
    ours = {name for name, dists in importlib.metadata.packages_distributions().items() if "moeplace" in dists}
    assert ours == {"moeplace"}, ours
    for name in ("foundation", "traces", "placement", "sim", "kernels", "dashboard"):
        spec = importlib.util.find_spec(name)
        assert spec is None or not str(spec.origin or "").startswith(str(REPO / "moeplace")), (name, spec)
