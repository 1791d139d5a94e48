"""The seam between the framework-free core and a framework: the few Horovod collectives
the core's decisions need, on small host-side values, within one process set.

Each framework implements ``Collectives`` once, under one class name
(``HorovodCollectives`` in hvd_dgc/torch/seam.py and hvd_dgc/tensorflow/seam.py); the
core's wrap-time and link logic runs on it and imports no framework:

- ``consistency.check_consistent``: every rank wrapped alike (one allgather);
- ``linkprobe.probe_link``: the link timed and agreed;
- ``host_peers`` (below): the ranks sharing this rank's host;
- the agreements of ``localcost`` and ``linkwatch`` (``max``).

``Alone`` is the seam of one process with no Horovod job (``python -m hvd_dgc.predict``).
Every method is a collective: every rank of the set calls it at the same point, with the
same ``name``.
"""

from typing import List, Protocol, Sequence

__all__ = ["Collectives", "Alone", "ProcessSet", "host_peers", "split_blobs"]


class Collectives(Protocol):
    """Horovod's collectives within one process set, on host-side values."""

    size: int        # ranks in the set
    rank: int        # this process's global rank
    ranks: List[int]  # the set's global ranks, in set order

    def allgather_bytes(self, blob: bytes, name: str) -> List[bytes]:
        """Every rank's ``blob``, in set order."""

    def max(self, values: Sequence[float], name: str) -> List[float]:
        """The largest of each value over the ranks (float64)."""

    def max_async(self, values: Sequence[float], name: str):
        """``max`` started, not waited for: a handle for ``wait``."""

    def wait(self, handle) -> List[float]:
        """What ``max_async`` started, once every rank has taken part."""

    def timed_allreduce(self, numel: int, name: str) -> float:
        """Seconds of one sum of ``numel`` float32 zeros, its result waited for."""

    def timed_allgather(self, numel: int, name: str) -> float:
        """Seconds of one allgather of ``numel`` float32 zeros from every rank."""

    def timed_alltoall(self, splits: Sequence[int], name: str) -> float:
        """Seconds of one alltoall sending ``splits[r]`` float32 zeros to set rank r."""


class ProcessSet:
    """What both frameworks' ``HorovodCollectives`` know of their Horovod process set:
    its size, this process's global rank and the set's global ranks."""

    def __init__(self, process_set, rank):
        self.process_set = process_set
        self.size = process_set.size()
        self.rank = rank
        self.ranks = list(process_set.ranks) if process_set.ranks else list(range(self.size))


def split_blobs(sizes, everything):
    """Every rank's blob from an allgather of their bytes (``everything``) and of their
    lengths (``sizes``), in set order."""
    blobs, offset = [], 0
    for size in sizes:
        blobs.append(bytes(everything[offset:offset + size]))
        offset += size
    return blobs


class Alone:
    """``Collectives`` of one process and no Horovod job: each collective returns this
    process's own values and takes no time."""

    size, rank, ranks = 1, 0, [0]

    def allgather_bytes(self, blob, name):
        return [bytes(blob)]

    def max(self, values, name):
        return [float(v) for v in values]

    def max_async(self, values, name):
        return self.max(values, name)

    def wait(self, handle):
        return handle

    def timed_allreduce(self, numel, name):
        return 0.0

    timed_allgather = timed_allreduce

    def timed_alltoall(self, splits, name):
        return 0.0


def host_peers(collectives, cross_rank):
    """The global ranks of the set whose host (Horovod's ``cross_rank``) is this rank's,
    sorted: one allgather, every rank of the set at the same point."""
    hosts = collectives.allgather_bytes(str(int(cross_rank)).encode(), "hvd_dgc.hosts")
    return tuple(r for r, h in zip(collectives.ranks, hosts) if int(h) == int(cross_rank))
