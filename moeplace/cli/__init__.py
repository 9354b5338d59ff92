"""moeplace.cli: the application layer — the ``place`` command line (``main``), one module per command
(``commands/``, the demo included), shared flag helpers (``flags``, ``sim_settings``) and the
design-space sweep (``sweep/``) that chains plan -> optimize -> simulate. The only package that imports
every stage; nothing imports it."""
