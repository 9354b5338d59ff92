"""The one compiled part of moeplace, optional: the stats pass's fused loop over a trace's expert-id byte
planes (moeplace/traces/_planes.c). Everything else is in pyproject.toml. ``optional=True``: without a C
compiler the install goes on and the pass runs its numpy version (same results, ~2x the CPU)."""
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "moeplace.traces._planes",
            ["moeplace/traces/_planes.c"],
            py_limited_api=True,  # the stable ABI of Python 3.11: one build for every later Python
            define_macros=[("Py_LIMITED_API", "0x030B0000")],
            extra_compile_args=["-O3"],
            optional=True,
        )
    ],
    options={"bdist_wheel": {"py_limited_api": "cp311"}},
)
