"""Start ``world_size`` local processes in one torch.distributed group and collect what each returns.

CPU: gloo over loopback; GPU: NCCL, one device per rank. Used by the tests and by
``place kernels bench``.
"""
from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, backend: str, port: int, fn: Callable, args: tuple, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # Each rank gets an equal share of the cores; oversubscribed BLAS threads distort timings.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        dist.barrier()
        queue.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - report any failure to the parent instead of hanging it
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, backend: str | None = None,
                    timeout: float = 600.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes; return results by rank.

    ``fn`` must be importable (module level). Raises ``RuntimeError`` with the failing rank's traceback.
    """
    backend = backend or ("nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size
                          else "gloo")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, backend, port, fn, args, queue), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world_size):
            rank, ok, value = queue.get(timeout=timeout)
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world_size)]
