"""The link probe (hvd_dgc/linkprobe.py) with Horovod's PyTorch allreduce, and DGC's own
work on this device (hvd_dgc/localcost.py) with the compressor's own selection and
record handling: ``cost_model="measure"``."""

import time

import torch
import horovod.torch as _hvd
from horovod.torch.mpi_ops import Max, Sum

from hvd_dgc.linkprobe import measure_link
from hvd_dgc.localcost import CALIBRATION_NUMEL, calibrate
from hvd_dgc.torch.memory import BLOCK

__all__ = ["measure", "measure_local"]


def _agree(process_set, name):
    def agree(values):
        return _hvd.allreduce(torch.tensor(values, dtype=torch.float64), op=Max,
                              name=name, process_set=process_set).tolist()
    return agree


def measure(process_set):
    """The agreed ``LinkMeasurement`` of ``process_set``'s ranks (None for one rank). Every
    rank of the set calls it at the same point (the wrapper, after the config check)."""
    def allreduce(numel):
        tensor = torch.zeros(numel)
        start = time.perf_counter()
        _hvd.allreduce(tensor, op=Sum, name=f"hvd_dgc.probe.{numel}", process_set=process_set)
        return time.perf_counter() - start

    def allgather(numel):
        tensor = torch.zeros(numel)
        start = time.perf_counter()
        _hvd.allgather(tensor, name=f"hvd_dgc.probe.gather.{numel}", process_set=process_set)
        return time.perf_counter() - start
    return measure_link(allreduce, _agree(process_set, "hvd_dgc.probe.agree"),
                        process_set.size(), allgather=allgather)


def measure_local(compressor, process_set, density, device):
    """The agreed ``LocalCost`` of ``compressor`` (a sparse one: ``pick``, ``pack``,
    ``records_at``) on ``device``: a launch's selection over a synthetic memory, and its
    records taken out of the memory, packed, unpacked and added, as the engine does."""
    gen = torch.Generator().manual_seed(0)
    v = torch.randn(CALIBRATION_NUMEL, generator=gen).to(device)
    block_max = v.view(-1, BLOCK).abs().amax(1)  # (the memory's update makes these)
    out = torch.zeros_like(v)

    def fastest(fn, times=3):
        best = float("inf")
        for _ in range(times):
            if v.is_cuda:
                torch.cuda.synchronize(v.device)
            start = time.perf_counter()
            fn()
            if v.is_cuda:
                torch.cuda.synchronize(v.device)
            best = min(best, time.perf_counter() - start)
        return best

    def select(numel, k):
        return fastest(lambda: compressor.pick(v, block_max, (0,), (numel,), (k,),
                                               ("hvd_dgc.calibrate",), 0, 0))

    def records(k):
        positions = torch.randperm(CALIBRATION_NUMEL, generator=gen)[:k].to(device)
        memory = v.clone()

        def once():
            values = memory.index_select(0, positions)  # what leaves the memory
            memory.index_fill_(0, positions, 0.0)
            wire = compressor.pack(values, positions)
            at, got = compressor.records_at(wire, (0,), (k,))
            out.index_add_(0, at, got)
        return fastest(once)
    return calibrate(select, records, _agree(process_set, "hvd_dgc.calibrate.agree"),
                     density)
