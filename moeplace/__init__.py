"""moeplace/: the application layer — the ``place`` CLI (``cli.py``), one module per command
(``commands/``, the demo included) and the design-space sweep (``sweep/``) that chains plan -> optimize
-> simulate. The only package that imports every stage; nothing imports it."""
