"""The link measured, not assumed (``cost_model="measure"``, the default).

The cost model (costmodel.py) chooses each tensor's path from a latency ``alpha`` per
message and a ``bandwidth``; ``CostModel()``'s describe 1 Gbit/s Ethernet. Unless the
script passes a ``CostModel`` (or the environment says ``HVD_DGC_COST_MODEL=assumed``)
the wrapper times Horovod's own ring allreduce at wrap time instead (PyTorch under
elastic Horovod: at each sync, where every rank is), with the collectives the training
will use (same process set, same controller), and fits the model's own formula for it::

    dense allreduce of n float32:  t(n) = 2 (N-1) alpha + 2 (N-1)/N * 4n / bandwidth

A one-element allreduce gives the latency; then larger ones, 64 KiB first, each sized from
the last so that its transfer takes TRANSFER_OVER_LATENCY times the latency (at most 64x
larger), until one does, or the largest size that fits the budget (at least twice the
last) has been timed; the line through the two gives alpha and the bandwidth. A far point
only twice the latency read the emulated 1 Gbit/s link at 246-696 Mbit/s and 10 Gbit/s at
560-2351 over six launches each; eight times, at 538-747 and 1342-2502 (stop 65). Each
size is timed twice and the faster kept (the first call of a shape negotiates it with
Horovod's coordinator; later ones hit its response cache, as a step's collectives do),
the second only where it fits the budget at the first's price; the two points of the line
three times more where that fits in half the budget. What Horovod adds to a message (its
cycle time, the cache's bit allreduce) is counted in alpha, as every collective of a step
pays it too.

Every rank must take the same decisions, or the probe's own collectives would not
match: each timing is agreed (the largest over the ranks: the slowest link decides) before
it decides anything, so the sizes tried, the stop and the result are the same on every
rank. The framework passes two functions: ``allreduce(numel)``, the seconds this rank
waited for one allreduce of ``numel`` float32, and ``agree(values)``, their elementwise
maximum over the ranks. Written once for PyTorch and TensorFlow.

Where the framework also passes ``allgather(numel)`` (the seconds this rank waited for an
allgather of ``numel`` float32 from every rank), the records' collective is timed too, at
the size whose bytes match the largest allreduce's, three times (the median: Horovod's
allgather of large buffers over TCP is bimodal, one call in two to five at the link's full
rate, the rest at about half, bench/results/collective_rates.md), and the sparse paths
are priced at its rate (``CostModel.gather_bandwidth``) where the budget allows it.

Inside a host (several hosts of several ranks each, where hierarchical DGC may run: the
framework passes ``alltoall(numel)``, the seconds this rank waited for Horovod's global
alltoall sending ``numel`` float32 to each other rank of its host and nothing across
hosts, the very collective of hierarchical DGC's first round), the same search fits::

    in-host alltoall, numel to each of L-1 peers:  t(n) = (L-1) alpha_local
                                                          + (L-1) 4n / bandwidth_local

on half a budget of its own, up to 4 MiB to each peer. Every Horovod collective of the
global set is negotiated by all its ranks, so alpha_local holds that negotiation's trip
across hosts as well: what the in-host round of a hierarchical step pays under Horovod,
not shared memory's 5 us.

The bandwidth is the effective rate of the largest message timed: on a long round trip
TCP's window grows over several trips, so the 64-300 KB that fit in the budget at 20 ms
see a tenth to a third of a 100 Mbit/s link's rate (tests/core/test_linkprobe.py); the model
then leans to sparse, the right side on such a link. On several hosts the allreduce's
ring crosses the link between them, its slowest hop: that is the link it measures.
"""

from typing import NamedTuple, Optional

from hvd_dgc.aggregation import allgather_bytes, dense_bytes
from hvd_dgc.costmodel import MEASURED_DENSE_PREFERENCE, CostModel

__all__ = ["HostMeasurement", "LinkMeasurement", "probe_link", "measure_link", "BUDGET_SECONDS"]

#: The probe tries no larger message that would take it past this (agreed time).
BUDGET_SECONDS = 1.0

#: The first bandwidth message (float32 elements: 64 KiB) and the largest (64 MiB).
FIRST_NUMEL, LARGEST_NUMEL = 16384, 16 * 1024 * 1024

#: The largest in-host message (float32 elements to each peer: 4 MiB). Its latency holds
#: a negotiation across hosts, which no in-host transfer need outweigh: past this the
#: in-host bytes cost little beside it, and on busy cores a larger one overran the budget.
HOST_LARGEST_NUMEL = 1024 * 1024

#: A size is large enough when its transfer takes this many times its latency part.
TRANSFER_OVER_LATENCY = 8.0


class HostMeasurement(NamedTuple):
    """The link inside a host as the in-host alltoall found it, the same on every rank."""

    alpha: float       # seconds per message (Horovod's negotiation included)
    bandwidth: float   # bytes per second a rank sends to its host's other ranks
    seconds: float     # this probe's agreed duration
    largest: int       # float32 elements sent to each peer in the largest one timed

    def numbers(self):
        return (f"inside a host {self.alpha * 1e6:.0f} us per message, "
                f"{self.bandwidth * 8 / 1e6:.0f} Mbit/s")


class LinkMeasurement(NamedTuple):
    """What the probe found, the same on every rank."""

    alpha: float       # seconds per message
    bandwidth: float   # bytes per second (the ring allreduce)
    seconds: float     # the probe's agreed duration
    largest: int       # float32 elements of the largest allreduce timed
    gather_bandwidth: Optional[float] = None  # bytes per second of an allgather; None:
    #                                           not timed (no function, or no budget left)
    host: Optional[HostMeasurement] = None  # inside a host; None: not measured (one
    #                                         rank a host, one host, or no function)

    def cost_model(self, base=None):
        """A ``CostModel`` with these numbers between ranks, and inside a host where
        measured (else ``base``'s), wanting a sparse path MEASURED_DENSE_PREFERENCE times
        cheaper than dense."""
        base = base or CostModel()
        local = (self.host.alpha, self.host.bandwidth) if self.host else (
            base.local_alpha, base.local_bandwidth)
        return CostModel(alpha=self.alpha, bandwidth=self.bandwidth,
                         local_alpha=local[0], local_bandwidth=local[1],
                         gather_bandwidth=self.gather_bandwidth,
                         dense_preference=MEASURED_DENSE_PREFERENCE)

    def words(self):
        """For the rank-0 line."""
        seconds = self.seconds + (self.host.seconds if self.host else 0.0)
        return f"link measured: {self.numbers()} (cost_model='measure', {seconds:.2f} s)"

    def numbers(self):
        gather = "" if self.gather_bandwidth is None else \
            f" (allgather {self.gather_bandwidth * 8 / 1e6:.0f})"
        host = f"; {self.host.numbers()}" if self.host else ""
        return (f"{self.alpha * 1e6:.0f} us per message, "
                f"{self.bandwidth * 8 / 1e6:.0f} Mbit/s{gather}{host}")


class _Timer:
    """Agreed timings of one collective, and the agreed seconds they took together."""

    def __init__(self, collective, agree, budget):
        self.collective, self.agree, self.budget = collective, agree, budget
        self.spent = 0.0

    def __call__(self, numel, times):
        """The fastest of up to ``times`` calls, each agreed (the slowest rank's): the
        first alone, the others only where they fit the budget at its price. Where one
        call takes a good part of the budget (4 ranks sharing 2 cores took 0.2-1.2 s a
        call, stop 65's CI), the probe makes the two calls its line needs, not five."""
        first = float(self.agree([self.collective(numel)])[0])
        self.spent += first
        if times < 2 or self.spent + (times - 1) * first > self.budget:
            return first
        local = [self.collective(numel) for _ in range(times - 1)]
        total, fastest = self.agree([sum(local), min(local)])
        self.spent += float(total)
        return min(first, float(fastest))


def _two_points(timed, budget, largest=LARGEST_NUMEL):
    """The sizes the line is fitted through, on every rank alike: ``(small, numel,
    transfer)``, the one-element time, the largest size timed (at most ``largest``) and
    its time past ``small`` (see the module docstring)."""
    timed.agree([0.0])  # every rank here first: a rank still starting up is not the link
    small = timed(1, 3)  # the latency part, and 4 bytes' transfer
    numel = FIRST_NUMEL
    while True:
        big = timed(numel, 2)
        transfer = max(big - small, 0.0)
        if transfer >= TRANSFER_OVER_LATENCY * small or numel >= largest:
            break
        grow = min(64.0, max(4.0, TRANSFER_OVER_LATENCY * small / max(transfer, small / 64)))
        bigger = min(largest, int(numel * grow))
        per_element = max(transfer, small / 64) / (numel - 1)  # (past the 1-element time)
        fits = int(((budget - timed.spent) / 2 - small) / per_element)
        if fits < 2 * numel:
            break  # no size twice this one fits the budget: the line through this one
        numel = min(bigger, fits)  # the largest that fits, where the one wanted does not
    if timed.spent + 3 * (small + big) <= budget / 2:
        # a rank descheduled during both timings of a size (ranks sharing cores) reads as
        # a slow link, and a slow link sends everything sparse: where the budget allows,
        # both points are timed three times more and the fastest kept
        small = min(small, timed(1, 3))
        transfer = max(min(big, timed(numel, 3)) - small, 0.0)
    return small, numel, transfer


def measure_host(alltoall, agree, local_size, budget=BUDGET_SECONDS):
    """``HostMeasurement`` from the framework's timed in-host ``alltoall`` (see the module
    docstring); None where a host has one rank."""
    if local_size < 2:
        return None
    timed = _Timer(alltoall, agree, budget)
    small, numel, transfer = _two_points(timed, budget, HOST_LARGEST_NUMEL)
    peers = local_size - 1
    bandwidth = peers * 4 * (numel - 1) / max(transfer, 1e-9)
    alpha = max(small - peers * 4 / bandwidth, 0.0) / peers
    return HostMeasurement(alpha, bandwidth, timed.spent, numel)


def measure_link(allreduce, agree, world, budget=BUDGET_SECONDS, allgather=None,
                 alltoall=None, local_size=1):
    """``LinkMeasurement`` from the framework's timed ``allreduce``, ``agree`` and (where
    given) ``allgather`` and in-host ``alltoall`` of ``local_size`` ranks (see the module
    docstring); None for a single rank (no link)."""
    if world < 2:
        return None
    timed = _Timer(allreduce, agree, budget)
    small, numel, transfer = _two_points(timed, budget)
    # the line through the two points: t(n) = latency + dense_bytes(n) / bandwidth
    extra_bytes = dense_bytes(numel, world, 4) - dense_bytes(1, world, 4)
    bandwidth = extra_bytes / max(transfer, 1e-9)  # (1e-9: a link too fast to time)
    latency = max(small - dense_bytes(1, world, 4) / bandwidth, 0.0)
    alpha = latency / (2 * (world - 1))
    gather = None
    # the records' collective at the allreduce's largest bytes, if three fit the budget
    # at half the allreduce's rate (the agreed times: every rank takes the same branch)
    gathered = max(1, int(dense_bytes(numel, world, 4) / allgather_bytes(1, world, 4)))
    if allgather is not None and timed.spent + 3 * (small + 2 * transfer) <= budget:
        local = [allgather(gathered) for _ in range(3)]
        *times, total = agree(local + [sum(local)])  # each call's slowest rank, and all
        timed.spent += float(total)
        moved = sorted(times)[1] - (world - 1) * alpha  # the median
        gather = allgather_bytes(gathered, world, 4) / max(moved, 1e-9)
    host = None if alltoall is None else measure_host(alltoall, agree, local_size,
                                                      budget / 2)
    return LinkMeasurement(alpha, bandwidth, timed.spent, numel, gather, host)


def probe_link(collectives, peers=()):
    """The agreed ``LinkMeasurement`` of a process set's ranks over its seam
    (hvd_dgc/seam.py ``Collectives``; None for one rank), and inside this rank's host
    where ``peers`` (its global ranks, hierarchical DGC's) are several. Every rank of the
    set calls it at the same point (the wrapper, or the build, after the config check)."""
    def allreduce(numel):
        return collectives.timed_allreduce(numel, f"hvd_dgc.probe.{numel}")

    def allgather(numel):
        return collectives.timed_allgather(numel, f"hvd_dgc.probe.gather.{numel}")

    def alltoall(numel):  # (hierarchical DGC's first round: nothing across hosts)
        splits = [numel if r in peers and r != collectives.rank else 0
                  for r in collectives.ranks]
        return collectives.timed_alltoall(splits, f"hvd_dgc.probe.host.{numel}")

    def agree(values):
        return collectives.max(values, "hvd_dgc.probe.agree")
    return measure_link(allreduce, agree, collectives.size, allgather=allgather,
                        alltoall=alltoall if len(peers) > 1 else None,
                        local_size=len(peers))


def probe_world(collectives, peers, compressor, resolved, timing, device=None):
    """``(LinkMeasurement, LocalCost or PayloadCost)`` of a process set, agreed by its
    ranks (each calls this at the same point): the link (``probe_link``), then the
    compressor's own work on this rank's ``device``, DGC's selection where it is sparse,
    the encoding and decoding where it allgathers payloads. ``timing`` is the framework's
    link module (torch/link.py, tensorflow/link.py: ``measure_local``,
    ``measure_payload``); (None, None) for one rank."""
    link = probe_link(collectives, peers)
    if link is None:
        return None, None
    if resolved.sparse:
        return link, timing.measure_local(compressor, collectives,
                                          resolved.final_density() or 0.001, device)
    if hasattr(compressor, "payload_bytes"):
        return link, timing.measure_payload(compressor, collectives, device)
    return link, None
