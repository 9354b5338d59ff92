"""The peer as users install it now: NVIDIA aisimulate (aiconfigurator's successor) on every end-to-end
fidelity case it supports, through the same call as bench/peer_aiconfigurator.py.

    python3.11 -m venv /tmp/aisimulate-venv          # its own environment: a 120 MB wheel pinning jax/flax
    /tmp/aisimulate-venv/bin/pip install aisimulate==0.13.0.dev202610270000000085
    /tmp/aisimulate-venv/bin/python bench/peer_aisimulate.py [--cases bench/fidelity_cases.yaml] \\
        [--out bench/results/peer_aisimulate.json]
    python bench/fidelity.py --peer-only           # joins it (and aiconfigurator 0.12's) into fidelity.json

aiconfigurator's development moved into ai-dynamo/aisimulate (Apache-2.0, PyPI ``aisimulate``);
``aiconfigurator-core`` ends at 0.12. The ``aisimulate 0.13.0`` release on PyPI is only a placeholder
source distribution whose build fetches the real wheel from NVIDIA's own package index (pypi.nvidia.com);
without that index the newest build a user can install from PyPI is the binary development wheel
``0.13.0.dev202610270000000085`` (built 2026-10-27; ``pip install aisimulate --pre`` picks it), which is
what this script was run with. That wheel carries the whole engine: a compiled step engine
(``aisimulate/_runtime.abi3.so``, the only executor of ``cli_estimate``), the silicon tables
(``aisimulate_core/systems``: H100/H200/B200/B300/GB200/GB300 and others, TensorRT-LLM, SGLang and vLLM,
each engine's ``current`` slot the same release as aiconfigurator 0.12's: TensorRT-LLM 1.3.0rc20, SGLang
0.5.14, vLLM 0.24.0), and aiconfigurator's Python API kept as a compatibility layer
(``aisimulate.legacy_cli.api.cli_estimate``, same arguments; the wheel says it is removed in 0.14.0).

Mapping: bench/peer_aiconfigurator.py's, imported from it, not copied (one rule for every case, its
docstring says which): the same ``cli_estimate`` keyword arguments per case, the same OOM bisection, the
same figure read from the result. The only difference is where the model configurations it ships live
(``aisimulate_core.sdk.utils``). The record says the exact version installed and the API called; it imports
nothing from moeplace. bench/fidelity.py joins it per case (``"peer": {"aisimulate": ...}``) and in
``peer_summary.aisimulate``: its errors on the cases it supports beside moeplace's and aiconfigurator 0.12's,
and where the two peer versions disagree.
"""
from __future__ import annotations

import sys
from importlib.metadata import version as installed_version
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the aiconfigurator peer's mapping, beside this script
from peer_aiconfigurator import ROOT, peer_main, run_cases  # noqa: F401  (run_cases: what the tests check)

OUT = ROOT / "bench" / "results" / "peer_aisimulate.json"
API = "aisimulate.legacy_cli.api.cli_estimate"
UTILS = "aisimulate_core.sdk.utils"
INDEX_NOTE = ("aisimulate 0.13.0 itself is only a placeholder source distribution on PyPI (its build fetches the "
              "wheel from NVIDIA's own package index, pypi.nvidia.com); {version} is the newest binary build users "
              "can install from PyPI without that index (pip install aisimulate --pre)")


def _load():
    from aisimulate.legacy_cli.api import cli_estimate  # the peer: installed in its own environment

    version = installed_version("aisimulate")
    return cli_estimate, {"version": version, "run": True, "api": API, "index": INDEX_NOTE.format(version=version),
                          "python": sys.version.split()[0]}


def main() -> int:
    return peer_main(__doc__, OUT, "aisimulate", _load, "see bench/peer_aisimulate.py's docstring", UTILS)


if __name__ == "__main__":
    sys.exit(main())
