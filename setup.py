"""The one compiled part of moeplace, optional: the loops of the trace statistics in C
(moeplace/traces/_loops.c: the stats pass's loop over a trace's expert-id byte planes, the affinity
statistic's top-k). Everything else is in pyproject.toml. ``optional=True``: without a C compiler the
install goes on and the numpy code runs (the same results, at about twice the CPU)."""
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "moeplace.traces._loops",
            ["moeplace/traces/_loops.c"],
            py_limited_api=True,  # the stable ABI of Python 3.11: one build for every later Python
            define_macros=[("Py_LIMITED_API", "0x030B0000")],
            extra_compile_args=["-O3"],
            optional=True,
        )
    ],
    options={"bdist_wheel": {"py_limited_api": "cp311"}},
)
