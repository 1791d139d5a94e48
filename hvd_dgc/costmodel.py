"""Alpha-beta cost model: dense ring allreduce, sparse allgather or region reduce, per tensor.

An allgather's volume grows with the number of workers N while a ring
allreduce's does not, so sparse only pays below a break-even density::

    dense ring allreduce      2(N-1) alpha + 2 (N-1)/N * n * w_dense * beta
    sparse allgather (k each) (N-1) alpha  +   (N-1)   * k * (w + i)  * beta
    break-even (alpha -> 0)   k/n < 2 w_dense / (N (w + i))

With fp32 values and int32 indices sparse wins below density 1/N; at the
first warm-up stage (25%) on 32 workers the allgather would move 8x the dense
volume. Every input is identical on every rank, so every rank picks the same
collective (a mismatch would hang Horovod).

Region reduce (hvd_dgc/aggregation.py, after Ok-Topk, PPoPP 2022) keeps the
sparse volume flat in N: an alltoall to the owners of R = min(N, 2k) index regions, a
re-sparsified sum on each owner, an allgather of quota = ceil(2k/R) records from each
(aggregation.KEEP = 2)::

    region reduce             2(N-1) alpha + [k(N-1)/N + quota R(N-1)/N] (w + i) beta

Hierarchical DGC (several hosts of L ranks each: Horovod's local_size > 1 and
cross_size > 1) first sums the dense gradient inside each host, over the fast
local links (a reduce-scatter: each rank holds its host's sum of one slice), then
each rank sends k/L records of its slice across hosts::

    hierarchical              (L-1) alpha_local + (L-1)/L n w_dense beta_local
                              + (N-1) alpha + (N-1) ceil(k/L) (w + i) beta

A compressor of its own collectives that allgathers a payload of ``p`` bytes a rank
(sign, QSGD, bf16: hvd_dgc/torch/quantize.py) is priced as DGC's allgather is::

    payload allgather         (N-1) alpha + (N-1) p beta + n (epsilon + N delta)

Its volume grows with N too: one bit an element (sign) moves more than the dense fp32
allreduce from N = 64 on, QSGD's default (7 levels: 4 bits an element) from N = 16, bf16
from N = 5 (``choose_exchange``); and its own work, encoding this rank's payload
(``encode_element_seconds``, epsilon) and decoding every rank's (``decode_element_seconds``,
delta), measured on this device by ``cost_model="measure"`` (0 otherwise), can cost more
than a fast link saves. PowerSGD's and TernGrad's allreduces are not priced: their volume
does not grow with N.

``choose`` (dense or allgather) is unchanged; ``choose_aggregation`` picks among
the four (hierarchical only where ``local_size`` says ranks share hosts).

A launch holding both (a bucket: a layer's small dense bias beside its sparse
weight) may carry its dense tensors inside its allgather, as records of every
index, instead of in an allreduce of their own (``folds``): N-1 copies of them
cross the wire instead of about two, but one Horovod operation fewer waits its
round trips (bench/results/round_trips.md: 3 round trips for one, 5 for two)::

    folded                    (N-1) * n * (w + i) * beta  <=  2(N-1) alpha + dense bytes beta

DGC's own work: a sparse path also selects (thresholds and a scan of the memory, per
element; the candidates kept, per record) and packs, unpacks and adds every rank's
records, which the dense path does not. With ``select_element_seconds``,
``select_record_seconds`` and ``record_seconds`` (0 by default: communication alone;
``cost_model="measure"`` calibrates them on this device, hvd_dgc/localcost.py) every
sparse path costs that much more::

    local (sparse paths)      n sigma + k rho_select + k N rho_record

so on a fast link the warm-up's dense-ish stages, where selecting and packing a quarter
of a tensor costs more than the allreduce it replaces, go dense.

What the sums leave out favours dense: Horovod's allreduce runs on its own thread while
the backward pass goes on, DGC's selection and packing on the training thread; and the
measured numbers move from run to run. So a sparse path must be predicted
``dense_preference`` times cheaper than the dense allreduce to be chosen (1: the sums
alone). The measured model asks for MEASURED_DENSE_PREFERENCE: at the warm-up's density
0.25 on an emulated 1 Gbit/s link (2 ranks, bench/never_slower.py) the sums came out
within a few percent of each other, and a run that went sparse on them made 23.3 img/s
where dense made 43-45 (stock Horovod 45.0).

That factor stands in for the overlap until PyTorch has timed the backward pass
(hvd_dgc/overlap.py, a few steps in): then each step is laid out on a timeline from
``path_seconds`` (each transfer, and DGC's work on the training thread), where the part
of a transfer the backward pass hides costs nothing, and where that plan differs from the
sums' both are run for a few steps and the faster is kept.

Where the script passes no ``cost_model``, the link is measured (``"measure"``,
hvd_dgc/linkprobe.py) unless the environment says ``HVD_DGC_COST_MODEL=assumed``: the
defaults below, so that the same script takes the same paths on every run (the measured
numbers move a little from run to run, and with them the paths of tensors near the
break-even).
"""

import os
from dataclasses import dataclass
from typing import Optional

from hvd_dgc.aggregation import allgather_bytes, dense_bytes, hierarchical_bytes, region_bytes
from hvd_dgc.paths import AGGREGATIONS, PathKind

__all__ = ["CostModel", "default_cost_model", "COST_MODEL_ENV", "MEASURED_DENSE_PREFERENCE"]

#: The environment variable that chooses the cost model where the script passes none.
COST_MODEL_ENV = "HVD_DGC_COST_MODEL"

#: How many times cheaper than the dense allreduce the measured model wants a sparse
#: path before choosing it (module docstring).
MEASURED_DENSE_PREFERENCE = 2.0

DENSE, ALLGATHER, REGION, HIERARCHICAL = (PathKind.DENSE, PathKind.ALLGATHER, PathKind.REGION,
                                          PathKind.HIERARCHICAL)


@dataclass(frozen=True)
class CostModel:
    """Latency ``alpha`` (seconds per message) and ``bandwidth`` (bytes/second) of the
    links between hosts; ``local_alpha`` and ``local_bandwidth`` of those inside a host
    (hierarchical DGC's dense first step).

    The defaults describe 1 Gbit/s Ethernet with 50 us per message, and shared memory
    (5 us, 10 GB/s) inside a host; only the ratio alpha*bandwidth matters for the
    choice among flat methods, and only for small tensors. ``select_element_seconds``
    (per element of a sparse tensor), ``select_record_seconds`` (per record selected)
    and ``record_seconds`` (per record of every rank unpacked and added): DGC's own
    work on a sparse path (module docstring); 0, communication alone, by default.
    ``gather_bandwidth``: the rate at which the records' collectives (allgather,
    alltoall) move bytes, where it differs from the ring allreduce's ``bandwidth``
    (None: the same). Horovod's allgather of large buffers over TCP moved them at about
    half the allreduce's rate (bench/results/collective_rates.md); the probe times it.
    ``dense_preference``: how many times cheaper a sparse path must be predicted than the
    dense allreduce to be chosen (module docstring; >= 1). ``encode_element_seconds`` and
    ``decode_element_seconds``: a payload compressor's own work per element, encoding
    this rank's payload and decoding each rank's (0 by default).
    """

    alpha: float = 50e-6
    bandwidth: float = 1.25e8
    local_alpha: float = 5e-6
    local_bandwidth: float = 1e10
    select_element_seconds: float = 0.0
    select_record_seconds: float = 0.0
    record_seconds: float = 0.0
    gather_bandwidth: Optional[float] = None
    dense_preference: float = 1.0
    encode_element_seconds: float = 0.0
    decode_element_seconds: float = 0.0

    def __post_init__(self):
        if not self.dense_preference >= 1:
            raise ValueError(f"CostModel.dense_preference must be >= 1 (1: the predicted "
                             f"times alone), got {self.dense_preference!r}")
        if self.gather_bandwidth is not None and not self.gather_bandwidth > 0:
            raise ValueError(f"CostModel.gather_bandwidth must be > 0 bytes/s or None (the "
                             f"allreduce's bandwidth), got {self.gather_bandwidth!r}")
        for name in ("alpha", "local_alpha", "select_element_seconds",
                     "select_record_seconds", "record_seconds", "encode_element_seconds",
                     "decode_element_seconds"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"CostModel.{name} must be >= 0 seconds, got "
                                 f"{getattr(self, name)!r}")
        for name in ("bandwidth", "local_bandwidth"):
            if not getattr(self, name) > 0:
                raise ValueError(f"CostModel.{name} must be > 0 bytes/s, got "
                                 f"{getattr(self, name)!r}")

    def launch_seconds(self, path, world_size):
        """The latency of one launch of ``path``: its rounds of N-1 messages (the dense
        ring's reduce-scatter and allgather, region reduce's alltoall and allgather, the
        allgather's one), whatever it carries. Hierarchical: its round across hosts."""
        rounds = 2 if path in (DENSE, REGION) else 1
        return rounds * (world_size - 1) * self.alpha

    def dense_seconds(self, numel, world_size, value_bytes):
        return self.launch_seconds(DENSE, world_size) + \
            dense_bytes(numel, world_size, value_bytes) / self.bandwidth

    @property
    def records_bandwidth(self):
        """Bytes per second of the collectives that carry records (allgather, alltoall)."""
        return self.bandwidth if self.gather_bandwidth is None else self.gather_bandwidth

    def sparse_seconds(self, k, world_size, value_bytes, index_bytes):
        return self.launch_seconds(ALLGATHER, world_size) + allgather_bytes(
            k, world_size, value_bytes + index_bytes) / self.records_bandwidth

    def local_seconds(self, numel, k, world_size):
        """DGC's own work on a sparse path beyond the dense path's (module docstring)."""
        return (numel * self.select_element_seconds + k * self.select_record_seconds
                + k * world_size * self.record_seconds)

    def choose(self, numel, k, world_size, dense_value_bytes=4, sparse_value_bytes=4,
               index_bytes=4):
        """DENSE or ALLGATHER for one tensor. Selecting everything is dense; ties go sparse,
        so np=1 (where both cost nothing) runs the same algorithm as np=2."""
        if k >= numel:
            return DENSE
        dense = self.dense_seconds(numel, world_size, dense_value_bytes)
        sparse = self.sparse_seconds(k, world_size, sparse_value_bytes, index_bytes) + \
            self.local_seconds(numel, k, world_size)
        return ALLGATHER if sparse * self.dense_preference <= dense else DENSE

    def gather_seconds(self, payload_bytes, world_size):
        """One allgather of ``payload_bytes`` from every rank (a payload compressor's)."""
        n1 = world_size - 1
        return n1 * self.alpha + n1 * payload_bytes / self.records_bandwidth

    def choose_exchange(self, numel, payload_bytes, world_size, dense_value_bytes=4,
                        chunk_bytes=None):
        """EXCHANGE (the compressor's allgather of ``payload_bytes`` a rank, with its
        encoding and the decoding of every rank's payload; or, given ``chunk_bytes``, the
        sign's compressed allreduce of chunks of that size: ``reduce_seconds``) or DENSE
        for one tensor of ``numel`` elements. Ties go to the compressor, so np=1 with no
        work measured (where both cost nothing) runs what np=2 runs; ``dense_preference``
        weighs the compressor's side as it weighs a sparse path (its work runs on the
        training thread)."""
        if chunk_bytes is None:
            exchange = self.gather_seconds(payload_bytes, world_size) + numel * (
                self.encode_element_seconds + world_size * self.decode_element_seconds)
        else:
            exchange = self.reduce_seconds(numel, chunk_bytes, world_size)
        dense = self.dense_seconds(numel, world_size, dense_value_bytes)
        return PathKind.EXCHANGE if exchange * self.dense_preference <= dense else DENSE

    def reduce_seconds(self, numel, chunk_bytes, world_size):
        """The sign's compressed allreduce (packing.sign_reduce_bytes): an alltoall and an
        allgather, each of N-1 chunks in; every element encoded once and its chunk's
        share again by its owner, and decoded twice (the owner's N chunks in, everyone's
        averages out)."""
        n1 = world_size - 1
        return 2 * n1 * self.alpha + 2 * n1 * chunk_bytes / self.records_bandwidth + \
            numel * (self.encode_element_seconds * (1 + 1 / world_size)
                     + 2 * self.decode_element_seconds)

    def folds(self, numel, world_size, value_bytes=4, index_bytes=4, dense_value_bytes=None):
        """Carry ``numel`` dense elements (a launch's dense tensors together) inside the
        launch's allgather rather than in an allreduce of their own? Yes where the
        allgather's extra bytes cost less than the allreduce they replace, latency
        included: small tensors (biases, norms), or any on a link of high latency.
        ``value_bytes``, ``index_bytes``: an element in the allgather;
        ``dense_value_bytes``: in the allreduce (default ``value_bytes``)."""
        if world_size < 2 or numel <= 0:
            return False
        extra = allgather_bytes(numel, world_size, value_bytes + index_bytes) / \
            self.records_bandwidth
        return extra <= self.dense_seconds(
            numel, world_size, value_bytes if dense_value_bytes is None else dense_value_bytes)

    def max_sparse_k(self, numel, world_size, dense_value_bytes=4, sparse_value_bytes=4,
                     index_bytes=4):
        """Largest k for which ``choose`` picks ALLGATHER (0: never). Sparse cost grows with
        k, so a graph (TensorFlow) can decide with one comparison ``k <= max_sparse_k``."""
        lo, hi = 0, numel - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.choose(numel, mid, world_size, dense_value_bytes, sparse_value_bytes,
                           index_bytes) == ALLGATHER:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def region_seconds(self, k, world_size, value_bytes, index_bytes):
        """Region reduce: alltoall of k(N-1)/N records in, allgather of quota R(N-1)/N
        in, quota = ceil(2k/R) of R = min(N, 2k) owners (aggregation.regions); two rounds
        of N-1 messages each."""
        return self.launch_seconds(REGION, world_size) + region_bytes(
            k, world_size, value_bytes + index_bytes) / self.records_bandwidth

    def hierarchical_seconds(self, numel, k, world_size, local_size, dense_value_bytes,
                             value_bytes, index_bytes):
        """Dense reduce-scatter inside the host, then an allgather of k/L records each."""
        local = local_size - 1
        return (local * self.local_alpha
                + local / local_size * numel * dense_value_bytes / self.local_bandwidth
                + (world_size - 1) * self.alpha
                + hierarchical_bytes(k, world_size, local_size, value_bytes + index_bytes)
                / self.records_bandwidth)

    def choose_aggregation(self, numel, k, world_size, dense_value_bytes=4,
                           sparse_value_bytes=4, index_bytes=4,
                           allowed=(DENSE, ALLGATHER, REGION), local_size=1,
                           gather_record_bytes=None, region_record_bytes=None):
        """Cheapest of ``allowed`` (DENSE, ALLGATHER, REGION, HIERARCHICAL) for one tensor.

        Selecting everything (k >= numel) is dense when DENSE is allowed. Equal costs
        go ALLGATHER, then REGION, then HIERARCHICAL, then DENSE: np=1 (all free) and np=2
        (region moves at least allgather's k records, in twice the messages) keep
        allgather, and with ``allowed=(DENSE, ALLGATHER)`` this is exactly ``choose``. A
        single name forces it. HIERARCHICAL is a candidate only where ranks share hosts
        and there are several hosts (1 < ``local_size`` < ``world_size``).
        """
        allowed = _allowed(allowed)
        if k >= numel and DENSE in allowed:
            return DENSE
        weight = self.dense_preference  # (the sparse paths' order among themselves stays)
        best, best_cost = None, None
        for name, (comm, local) in self.path_seconds(
                numel, k, world_size, dense_value_bytes, sparse_value_bytes, index_bytes,
                allowed, local_size, gather_record_bytes, region_record_bytes).items():
            c = comm if name == DENSE else weight * (comm + local)
            if best is None or c < best_cost:
                best, best_cost = name, c
        return best

    def path_seconds(self, numel, k, world_size, dense_value_bytes=4, sparse_value_bytes=4,
                     index_bytes=4, allowed=(DENSE, ALLGATHER, REGION), local_size=1,
                     gather_record_bytes=None, region_record_bytes=None):
        """``{path: (transfer seconds, DGC's local work seconds)}`` for each of
        ``allowed`` that applies (HIERARCHICAL only where 1 < ``local_size`` <
        ``world_size``, unless it is the only one), in the order of preference on equal
        cost (``AGGREGATIONS``). ``choose_aggregation`` weighs them;
        overlap.choose_paths places them on the step's timeline. ``index_bytes``: a
        record's position; ``gather_record_bytes``, where the allgather codes its records
        (hvd_dgc/packing.py: positions near ``index_bytes(n, k) / k``, values perhaps in 8
        bits), a record on the allgather instead of ``sparse_value_bytes + index_bytes``;
        ``region_record_bytes`` likewise on region reduce's (packing.region_record)."""
        allowed = _allowed(allowed)
        if len(allowed) > 1 and not 1 < local_size < world_size:
            allowed = tuple(a for a in allowed if a != HIERARCHICAL)
        local = self.local_seconds(numel, k, world_size)  # DGC's own work, sparse paths
        cost = {
            HIERARCHICAL: lambda: self.hierarchical_seconds(
                numel, k, world_size, local_size, dense_value_bytes, sparse_value_bytes,
                index_bytes),
            ALLGATHER: lambda: self.sparse_seconds(
                k, world_size, sparse_value_bytes, index_bytes) if gather_record_bytes is None
            else self.sparse_seconds(k, world_size, gather_record_bytes, 0),
            REGION: lambda: self.region_seconds(k, world_size, sparse_value_bytes,
                                                index_bytes) if region_record_bytes is None
            else self.region_seconds(k, world_size, region_record_bytes, 0),
            DENSE: lambda: self.dense_seconds(numel, world_size, dense_value_bytes),
        }
        return {name: (cost[name](), 0.0 if name == DENSE else local)
                for name in AGGREGATIONS if name in allowed}

    def config(self):
        return ("CostModel", self.alpha, self.bandwidth, self.local_alpha,
                self.local_bandwidth, self.select_element_seconds, self.select_record_seconds,
                self.record_seconds, self.gather_bandwidth, self.dense_preference,
                self.encode_element_seconds, self.decode_element_seconds)


def _allowed(allowed):
    """``allowed`` paths as a tuple (a single name: that one), checked."""
    allowed = (allowed,) if isinstance(allowed, str) else tuple(allowed)
    unknown = [a for a in allowed if a not in AGGREGATIONS]
    if unknown or not allowed:
        raise ValueError(f"allowed must name some of {AGGREGATIONS}, got {allowed!r}")
    return allowed


def default_cost_model(environ=None):
    """The cost model where the script passes none: ``"measure"``, or ``CostModel()``
    with ``HVD_DGC_COST_MODEL=assumed`` (module docstring)."""
    raw = (os.environ if environ is None else environ).get(COST_MODEL_ENV, "")
    value = raw.strip().lower() or "measure"
    if value == "measure":
        return "measure"
    if value == "assumed":
        return CostModel()
    raise ValueError(f"{COST_MODEL_ENV}={raw!r}: expected 'measure' (the link timed at wrap "
                     f"time, the default) or 'assumed' (1 Gbit/s and 50 us per message: "
                     f"the same paths on every run); or pass cost_model= to the optimizer.")
