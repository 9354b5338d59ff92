"""moeplace: routing traces, expert placement and cluster simulation for huge sparse MoE models.

One namespace, layered along the data flow (each subpackage imports only those before it):
``foundation`` -> ``traces`` -> ``placement`` -> ``sim`` -> ``kernels`` -> ``dashboard`` -> ``cli``.
The layer contract is written in pyproject.toml and checked by tests/test_layers.py."""
