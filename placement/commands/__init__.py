"""CLI commands, one module per command (or per subcommand of a group such as ``place trace``).

A module defines ``register(subparsers)`` and, to live under a group, ``GROUP = "trace"`` (plus an
optional ``GROUP_HELP``). Handlers take the parsed ``args`` and return an exit code. The CLI discovers
the modules; adding a command touches only its own file.
"""
