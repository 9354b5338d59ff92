"""sim/: a discrete-event cluster simulator driven by routing traces (docs/design.md "Layers").

Layers, from the bottom: ``events`` (the deterministic event kernel), ``config`` (frozen run
configuration), ``cost`` + ``calibration`` (roofline per operation, corrected by a measured profile),
``memory`` (admission pools from the ``place plan`` model), ``workload`` (requests from a trace or an
arrival process), ``routing`` (exact replay and a fitted statistical mode), ``engine`` (continuous
batching over attention-DP ranks and EP MoE layers), ``rebalance``, ``results`` and ``chrome_trace``.
"""
