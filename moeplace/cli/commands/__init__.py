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


GROUP_HELP = {
    "trace": "routing traces: synth, validate, stats, import, capture",
    "model": "model presets and Hugging Face configs",
    "kernels": "real expert-parallel dispatch/combine kernels (torch.distributed)",
}
