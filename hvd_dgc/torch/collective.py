"""Compressors that run their own collectives: the optimizer's third path, beside dense
allreduce and sparse allgather (optimizer.py).

PowerSGD needs two allreduces per step with local maths in between, TernGrad a
max before its sum, and sign / QSGD / bf16 payloads are not summable by
Horovod 0.28.1's allreduce. So these compressors do their own communication
through a small protocol the optimizer drives, for a list of flat tensors
(one parameter, or one Horovod group)::

    ex = compressor.launch(residuals, keys, name, comm)  # in the backward hook: round 1
    compressor.advance(ex)       # in synchronize, for every launch before any wait: round 2
    averages = compressor.collect(ex)                     # wait; average over the ranks

``residuals`` are the memory's buffers ``v`` (this step's input plus the old
residual), viewed in their parameters' shapes; ``averages`` come back flat. Error feedback: as soon as the compressor knows what this rank
effectively sent (``ex.sent``, decompressed), it subtracts it from ``v`` in
place, so ``sent + residual = input + old residual`` holds exactly, whatever
the compressor. One-round compressors (``sent_at_launch``) know it at launch,
which delayed averaging (``delay=``) needs; PowerSGD and TernGrad only after
their first round.
"""

import math

import torch
import horovod.torch as _hvd
from horovod.torch.compression import Compressor
from horovod.torch.mpi_ops import Average, Max, Sum

from hvd_dgc._guard import called_from_horovod_allreduce, not_summable_error
from hvd_dgc.torch.options import Options

__all__ = ["EXCHANGE", "ExchangeCompressor", "GatherCompressor", "HorovodComm", "LocalComm",
           "is_exchange", "Average", "Max", "Sum"]

EXCHANGE = "exchange"


class HorovodComm:
    """Horovod's asynchronous collectives on one process set."""

    def __init__(self, process_set):
        self.process_set = process_set

    def size(self):
        return self.process_set.size()

    def rank(self):
        return _hvd.rank()

    def allreduce_async(self, tensor, name, op):
        return _hvd.allreduce_async_(tensor, name=name, op=op, process_set=self.process_set)

    def allgather_async(self, tensor, name):
        return _hvd.allgather_async(tensor, name=name, process_set=self.process_set)

    def alltoall_async(self, tensor, splits, name):
        """Rows ``splits[j]`` of ``tensor`` to rank j; ``wait`` gives ``(received,
        received splits)``."""
        return _hvd.alltoall_async(tensor, splits=torch.tensor(splits, dtype=torch.int32),
                                   name=name, process_set=self.process_set)

    def wait(self, handle):
        return _hvd.synchronize(handle)


class LocalComm:
    """A world of one process: every collective returns its input (tests, benchmarks)."""

    def size(self):
        return 1

    def rank(self):
        return 0

    def allreduce_async(self, tensor, name, op):
        return tensor

    def allgather_async(self, tensor, name):
        return tensor

    def alltoall_async(self, tensor, splits, name):
        return tensor, torch.tensor(splits, dtype=torch.int32)

    def wait(self, handle):
        return handle


class Exchange:
    """One launch in flight: the compressor keeps what it needs to finish it here."""

    def __init__(self, comm, name, residuals, keys):
        self.comm, self.name, self.residuals, self.keys = comm, name, residuals, keys
        self.sent = None   # this rank's decompressed contributions, once known
        self.handle = None
        self.round = 1


class ExchangeCompressor(Options, Compressor):
    """Base of the compressors that communicate themselves (see the module doc)."""

    exchanges = True
    sent_at_launch = True
    summable_why = "it runs its own collectives"

    def compressible(self, shape, step):
        """Whether a tensor of ``shape`` goes through this compressor at ``step``
        (same answer on every rank); otherwise it is allreduced dense."""
        return True

    def wire_bytes(self, shape, world=1):
        """Bytes this rank puts into the collectives for one tensor of ``shape`` on
        ``world`` ranks."""
        raise NotImplementedError

    def wire_shares(self, shapes, world=1):
        """``wire_bytes`` of tensors of ``shapes`` that leave in one launch, each
        tensor's share (a compressor whose payload covers several tensors at once
        splits it: the sign's compressed allreduce)."""
        return [self.wire_bytes(shape, world) for shape in shapes]

    def launch(self, residuals, keys, name, comm):
        raise NotImplementedError

    def advance(self, ex):
        """Start the next round, if any (every rank calls it for every launch first)."""

    def collect(self, ex):
        raise NotImplementedError

    @staticmethod
    def keep_residual(ex):
        """Error feedback: take what this rank sent out of its memory."""
        for v, s in zip(ex.residuals, ex.sent):
            v.view(-1).sub_(s.view(-1))

    # -- Horovod's Compressor API ---------------------------------------------
    def _refuse_allreduce(self):
        if called_from_horovod_allreduce(depth=3):
            raise not_summable_error(repr(self), self.summable_why)

    def compress(self, tensor):
        self._refuse_allreduce()
        raise TypeError(f"{self!r} {self.summable_why}; it has no single payload to "
                        f"compress. Use hvd_dgc.torch.DistributedOptimizer(compression="
                        f"{self!r}).")

    def decompress(self, tensor, ctx):
        self._refuse_allreduce()
        raise TypeError(f"{self!r} {self.summable_why}; see compress().")


class GatherCompressor(ExchangeCompressor):
    """One allgather of per-rank payloads (uint8), each decoded and averaged locally.

    Subclasses give ``encode(flat, rank) -> uint8 payload`` and
    ``decode(payload, numel, dtype) -> flat``; every rank decodes the gathered
    payloads in rank order, so every rank gets the same average bit for bit.
    The standalone ``compress``/``decompress`` are encode and decode-and-average:
    allgather the payload in between, never allreduce it.
    """

    def wire_bytes(self, shape, world=1):
        return self.payload_bytes(math.prod(shape))

    def launch(self, residuals, keys, name, comm):
        ex = Exchange(comm, name, residuals, keys)
        payloads = [self.encode(v.view(-1), comm.rank()) for v in residuals]
        ex.sent = [self.decode(b, v.numel(), v.dtype) for b, v in zip(payloads, residuals)]
        self.keep_residual(ex)
        ex.sizes = [b.numel() for b in payloads]
        ex.handle = comm.allgather_async(torch.cat(payloads), name + ".gather")
        return ex

    def collect(self, ex):
        gathered = ex.comm.wait(ex.handle).view(ex.comm.size(), -1)
        averages, offset = [], 0
        for size, v in zip(ex.sizes, ex.residuals):
            averages.append(self.average(gathered[:, offset:offset + size], v.numel(), v.dtype))
            offset += size
        return averages

    def average(self, rows, numel, dtype):
        total = self.decode(rows[0], numel, dtype)
        for r in range(1, rows.shape[0]):
            total.add_(self.decode(rows[r], numel, dtype))
        return total.div_(rows.shape[0])

    def compress(self, tensor):
        self._refuse_allreduce()
        flat = tensor.detach().reshape(-1)
        return self.encode(flat, 0), (tensor.shape, tensor.dtype, flat.numel())

    def decompress(self, tensor, ctx):
        """Average of the decoded payloads of every rank (the allgather's result)."""
        self._refuse_allreduce()
        shape, dtype, numel = ctx
        rows = tensor.reshape(-1, self.payload_bytes(numel))
        return self.average(rows, numel, torch.float32).view(shape).to(dtype)


def is_exchange(compression):
    return getattr(compression, "exchanges", False)
