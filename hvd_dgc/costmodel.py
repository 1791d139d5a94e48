"""Alpha-beta cost model: dense ring allreduce or sparse allgather, per tensor, per step.

An allgather's volume grows with the number of workers N while a ring
allreduce's does not, so sparse only pays below a break-even density::

    dense ring allreduce      2(N-1) alpha + 2 (N-1)/N * n * w_dense * beta
    sparse allgather (k each) (N-1) alpha  +   (N-1)   * k * (w + i)  * beta
    break-even (alpha -> 0)   k/n < 2 w_dense / (N (w + i))

With fp32 values and int32 indices sparse wins below density 1/N; at the
first warm-up stage (25%) on 32 workers the allgather would move 8x the dense
volume. Every input is identical on every rank, so every rank picks the same
collective (a mismatch would hang Horovod).
"""

from dataclasses import dataclass

__all__ = ["CostModel", "DENSE", "SPARSE"]

DENSE = "dense"
SPARSE = "sparse"


@dataclass(frozen=True)
class CostModel:
    """Latency ``alpha`` (seconds per message) and ``bandwidth`` (bytes/second).

    The defaults describe 1 Gbit/s Ethernet with 50 us per message; only the
    ratio alpha*bandwidth matters for the choice, and only for small tensors.
    """

    alpha: float = 50e-6
    bandwidth: float = 1.25e8

    def __post_init__(self):
        if not self.alpha >= 0:
            raise ValueError(f"CostModel.alpha must be >= 0 seconds, got {self.alpha!r}")
        if not self.bandwidth > 0:
            raise ValueError(f"CostModel.bandwidth must be > 0 bytes/s, got {self.bandwidth!r}")

    def dense_seconds(self, numel, world_size, value_bytes):
        n1 = world_size - 1
        return 2 * n1 * self.alpha + 2.0 * n1 / world_size * numel * value_bytes / self.bandwidth

    def sparse_seconds(self, k, world_size, value_bytes, index_bytes):
        n1 = world_size - 1
        return n1 * self.alpha + n1 * k * (value_bytes + index_bytes) / self.bandwidth

    def choose(self, numel, k, world_size, dense_value_bytes=4, sparse_value_bytes=4,
               index_bytes=4):
        """DENSE or SPARSE for one tensor. Selecting everything is dense; ties go sparse,
        so np=1 (where both cost nothing) runs the same algorithm as np=2."""
        if k >= numel:
            return DENSE
        dense = self.dense_seconds(numel, world_size, dense_value_bytes)
        sparse = self.sparse_seconds(k, world_size, sparse_value_bytes, index_bytes)
        return SPARSE if sparse <= dense else DENSE

    def max_sparse_k(self, numel, world_size, dense_value_bytes=4, sparse_value_bytes=4,
                     index_bytes=4):
        """Largest k for which ``choose`` picks SPARSE (0: never). Sparse cost grows with
        k, so a graph (TensorFlow) can decide with one comparison ``k <= max_sparse_k``."""
        lo, hi = 0, numel - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.choose(numel, mid, world_size, dense_value_bytes, sparse_value_bytes,
                           index_bytes) == SPARSE:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def config(self):
        return ("CostModel", self.alpha, self.bandwidth)
