"""hvd_dgc/seam.py's ``Collectives`` with Horovod's PyTorch collectives (eager)."""

import time

import torch
import horovod.torch as _hvd
from horovod.torch.mpi_ops import Max, Sum

from hvd_dgc.seam import ProcessSet, split_blobs

__all__ = ["HorovodCollectives"]


class HorovodCollectives(ProcessSet):
    """Horovod's PyTorch collectives within ``process_set`` (hvd_dgc/seam.py)."""

    def __init__(self, process_set):
        super().__init__(process_set, _hvd.rank())

    def allgather_bytes(self, blob, name):
        mine = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else \
            torch.zeros(0, dtype=torch.uint8)
        sizes = _hvd.allgather(torch.tensor([mine.numel()], dtype=torch.int64),
                               name=f"{name}.size", process_set=self.process_set).tolist()
        everything = _hvd.allgather(mine, name=name, process_set=self.process_set)
        return split_blobs(sizes, everything.numpy().tobytes())

    def max(self, values, name):
        return _hvd.allreduce(torch.tensor(values, dtype=torch.float64), op=Max, name=name,
                              process_set=self.process_set).tolist()

    def max_async(self, values, name):
        return _hvd.allreduce_async(torch.tensor(values, dtype=torch.float64), op=Max,
                                    name=name, process_set=self.process_set)

    def wait(self, handle):
        return _hvd.synchronize(handle).tolist()

    def timed_allreduce(self, numel, name):
        tensor = torch.zeros(numel)
        start = time.perf_counter()
        _hvd.allreduce(tensor, op=Sum, name=name, process_set=self.process_set)
        return time.perf_counter() - start

    def timed_allgather(self, numel, name):
        tensor = torch.zeros(numel)
        start = time.perf_counter()
        _hvd.allgather(tensor, name=name, process_set=self.process_set)
        return time.perf_counter() - start

    def timed_alltoall(self, splits, name):
        tensor = torch.zeros(int(sum(splits)))
        start = time.perf_counter()
        _hvd.alltoall(tensor, splits=torch.tensor(list(splits), dtype=torch.int32), name=name,
                      process_set=self.process_set)
        return time.perf_counter() - start
