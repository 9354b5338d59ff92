"""CLI commands, one module per command (or per subcommand of a group such as ``place trace``).

A module defines ``register(subparsers)`` and, to live under a group, ``GROUP = "trace"``; a group's
one-line help is in ``GROUP_HELP`` below. Handlers take the parsed ``args`` and return an exit code.
The CLI discovers the modules; adding a command touches only its own file.
"""

from moeplace.foundation.model import DEFAULT_MODEL

FORCE_HELP = ("replace an existing output that moeplace itself wrote, of the same kind (a trace directory, a "
              "placement JSON, ...); any other existing path is never replaced")


def add_force(p) -> None:
    """The ``--force`` flag of every command that writes (the rule: ``foundation.files.check_output``)."""
    p.add_argument("--force", action="store_true", help=FORCE_HELP)


def add_model(p) -> None:
    """The ``--model`` flag of the commands that read inputs carrying no model (engine dumps, logs) or make
    one from nothing (synthesis): a preset name or a Hugging Face config.json."""
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"model preset or config.json (default {DEFAULT_MODEL})")


NO_PROGRESS_HELP = ("no progress bar on stderr (bars are drawn only when stderr is a terminal; "
                    "MOEPLACE_PROGRESS=1 forces them, =0 turns them off)")


def add_progress(p) -> None:
    """The ``--no-progress`` flag of the commands with steps that can take more than a few seconds; a
    command that has it runs with :mod:`foundation.progress` bars switched by it (``cli.main``)."""
    p.add_argument("--no-progress", action="store_true", help=NO_PROGRESS_HELP)


def add_json(p, what: str) -> None:
    """The ``--json`` flag of the commands that write or check a file: one JSON object on stdout (``what``
    it holds) instead of the text summary; warnings stay on stderr and are in the object too."""
    p.add_argument("--json", action="store_true", help=f"print one JSON object on stdout: {what}")


GROUP_HELP = {
    "trace": "routing traces: synth, validate, stats, import, capture",
    "model": "model presets and Hugging Face configs",
    "kernels": "real expert-parallel dispatch/combine kernels (torch.distributed)",
}


INPUT_HELP = ("routing trace (Parquet file or directory) or Loads .npz (place trace stats --out, an engine dump's "
              "import)")


def add_workload_input(p, name: str, loads_note: str, phases_note: str) -> None:
    """The input of a serving simulation: a trace or Loads file as ``name``, or ``--phases`` instead."""
    p.add_argument(name, nargs="?", default=None, help=INPUT_HELP + loads_note)
    p.add_argument("--phases", default=None, metavar="SRC:SECONDS[,SRC:SECONDS...]",
                   help=f"instead of {name.upper()}: inputs (traces or Loads) one after the other for the given "
                        f"simulated seconds each, e.g. morning.npz:600,evening.npz:900{phases_note}; without "
                        "seconds (morning.npz,evening.npz) each lasts in proportion to its traffic, as one "
                        "input's windows do (at most 100 entries; a file named twice is read once)")
