"""The link probe (hvd_dgc/linkprobe.py) with Horovod's PyTorch allreduce."""

import time

import torch
import horovod.torch as _hvd
from horovod.torch.mpi_ops import Max, Sum

from hvd_dgc.linkprobe import measure_link

__all__ = ["measure"]


def measure(process_set):
    """The agreed ``LinkMeasurement`` of ``process_set``'s ranks (None for one rank). Every
    rank of the set calls it at the same point (the wrapper, after the config check)."""
    def allreduce(numel):
        tensor = torch.zeros(numel)
        start = time.perf_counter()
        _hvd.allreduce(tensor, op=Sum, name=f"hvd_dgc.probe.{numel}", process_set=process_set)
        return time.perf_counter() - start

    def agree(values):
        return _hvd.allreduce(torch.tensor(values, dtype=torch.float64), op=Max,
                              name="hvd_dgc.probe.agree", process_set=process_set).tolist()
    return measure_link(allreduce, agree, process_set.size())
