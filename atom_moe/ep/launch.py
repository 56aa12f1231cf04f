"""Start torch.distributed from whatever launched us: torchrun, mpirun/mpiexec, or nothing.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT: we use env://.
Under an MPI launcher (Open MPI, MPICH/Hydra, Intel MPI, MVAPICH, Slurm PMI) mpi4py gives
rank and world; rank 0 picks the rendezvous address and a free port and broadcasts them
over MPI. Without either, this is a single process (world size 1).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# environment variables an MPI launcher sets in every rank (the rank variable of each family)
MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK", "MPI_LOCALRANKID")


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: global rank, world size, rank on its host, and who launched it."""

    rank: int
    world_size: int
    local_rank: int
    launcher: str  # "torchrun", "mpi", "single" or "existing"


def free_port() -> int:
    """A TCP port that is free right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def host_address() -> str:
    """This host's address as other hosts reach it (falls back to loopback)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def under_mpi() -> bool:
    """True when an MPI launcher started this process."""
    return any(v in os.environ for v in MPI_RANK_VARS)


def init_distributed(backend: str | None = None, timeout: timedelta = timedelta(minutes=5)) -> DistInfo:
    """Initialize the default process group from torchrun or MPI (or as a single process); idempotent.

    backend: "nccl" when CUDA is available, else "gloo". On CUDA the current device becomes
    the local rank's GPU. `timeout` bounds every collective, so a failed peer becomes an
    error instead of a hang.
    """
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if dist.is_initialized():
        return DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)), "existing")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", 0))
        _set_device(backend, local)
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world, timeout=timeout)
        return DistInfo(rank, world, local, "torchrun")
    if under_mpi():
        return _init_from_mpi(backend, timeout)
    _set_device(backend, 0)
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return DistInfo(0, 1, 0, "single")


def _init_from_mpi(backend: str, timeout: timedelta) -> DistInfo:
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise RuntimeError("launched by an MPI launcher but mpi4py is not installed: pip install mpi4py "
                           "(and an MPI, e.g. pip install mpich), or launch with torchrun") from exc
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    local = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()  # rank among the processes of this host
    addr_port = None
    if rank == 0:
        addr_port = (os.environ.get("MASTER_ADDR") or host_address(),
                     int(os.environ.get("MASTER_PORT") or free_port()))
    addr, port = comm.bcast(addr_port, root=0)
    # torch code that reads the torchrun variables sees the same values
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local),
                      MASTER_ADDR=addr, MASTER_PORT=str(port))
    _set_device(backend, local)
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world,
                            timeout=timeout)
    return DistInfo(rank, world, local, "mpi")


def _set_device(backend: str, local_rank: int) -> None:
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError("backend 'nccl' needs CUDA GPUs, and none is visible; use backend='gloo' on the CPU")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
