"""kernels/: real expert-parallel MoE at small scale — dispatch, grouped expert GEMMs and combine over
torch.distributed (gloo on CPU, NCCL on GPU), a single-process reference, and the benchmark that writes
the simulator's calibration profile.

A leaf of the flow: it reads Placements (placement/) and the calibration schema (sim/), and nothing
imports it except the CLI.

Note on the name: Hugging Face also publishes a package importable as ``kernels`` (hub kernels), which
transformers probes for. tests/test_import_names.py checks that ours does not change transformers'
behaviour.
"""
