"""PowerSGD (Vogels et al., NeurIPS 2019): rank-r gradient compression by one power iteration.

Each compressed tensor is viewed as a matrix M (shape[0] x the rest) and sent
as two thin factors, (n + m) * r numbers instead of n * m, both summable::

    P = M Q          allreduce(P, Sum)      P <- orthonormal columns of P
    Q = M^T P        allreduce(Q, Average)  average ~ P Q^T

Q is kept from step to step (warm start: one power iteration per step then
tracks the gradient's top subspace), and starts from a random matrix that
every rank draws alike from the compressor's seed and the parameter's name
(its own generator: the global RNG is untouched). Error feedback as in the
paper and torch's ``powerSGD_hook``: the residual is M - P Q^T, the part of
the *average* approximation this rank's input did not contain. A tensor is
compressed only where (n + m) * r * min_rate < n * m (1-D tensors never),
and only from step ``start_iter`` on (dense allreduce before: early
training is sensitive to compression). Same numbers as torch's hook for the
same gradients, rank and initial Q (tests/torch/test_compressors.py).
"""

import zlib

import torch

from hvd_dgc.lowrank import LowRankPlan
from hvd_dgc.torch.collective import Average, Exchange, ExchangeCompressor, Sum

__all__ = ["PowerSGDCompressor", "orthogonalize"]


def orthogonalize(matrix, epsilon=0.0):
    """Make the columns of ``matrix`` (rows x r) orthonormal, in place: Gram-Schmidt for
    r <= 2 (as torch's hook), Householder QR above (faster, same subspace)."""
    r = matrix.shape[1]
    if r > 2 and matrix.dtype not in (torch.float16, torch.bfloat16):
        matrix.copy_(torch.linalg.qr(matrix).Q)
        return matrix
    for i in range(r):
        col = matrix[:, i:i + 1]
        col /= torch.linalg.vector_norm(col, dim=0, keepdim=True) + epsilon
        if i + 1 < r:
            rest = matrix[:, i + 1:]
            rest -= (col * rest).sum(dim=0, keepdim=True) * col
    return matrix


class PowerSGDCompressor(LowRankPlan, ExchangeCompressor):
    """PowerSGD with error feedback and warm start (see the module doc).

    Args:
        rank: r, the rank of the approximation (1-4 typical; 1 = most compression).
        start_iter: dense allreduce for steps before this one (torch's
            ``start_powerSGD_iter``; its default 1000).
        min_rate: compress only if it saves at least this factor (torch's
            ``min_compression_rate``).
        warm_start: keep Q between steps (else a fresh random Q every step).
        epsilon: added to column norms when orthogonalising. torch's default is
            0; 1e-8 here so that an all-zero gradient (an unused parameter)
            gives zeros, not NaN.
        seed: seeds the initial Q, identically on every rank.
    """

    name = "powersgd"
    random = True  # fresh Qs without warm start: its own generators, in its state_dict
    sent_at_launch = False

    def __init__(self, rank=1, start_iter=1000, min_rate=2.0, warm_start=True, epsilon=1e-8,
                 seed=0):
        self._set_plan(rank, start_iter, min_rate, warm_start, epsilon)
        self.seed = int(seed)
        self._q = {}         # key -> Q (m x r), the warm start
        self._q_gens = {}    # key -> generator of fresh Qs

    # -- which tensors, and what they cost: hvd_dgc/lowrank.py -------------------
    def compressible(self, shape, step):
        return step >= self.start_iter and self.saves(shape)

    # -- Q: shared seed, warm start --------------------------------------------
    def _seeded(self, key):
        return torch.Generator().manual_seed((self.seed << 32) ^ zlib.crc32(key.encode()))

    def initial_q(self, key, m, r, dtype=torch.float32):
        """The random Q every rank starts ``key`` from (before orthogonalisation)."""
        return torch.randn(m, r, generator=self._seeded(key), dtype=dtype)

    def _start_q(self, key, m, r, v):
        if self.warm_start:
            q = self._q.get(key)
            if q is None or q.shape != (m, r):
                q = self.initial_q(key, m, r, v.dtype)
        else:  # a fresh Q every step, from a stream that starts with initial_q
            gen = self._q_gens.setdefault(key, self._seeded(key))
            q = torch.randn(m, r, generator=gen, dtype=v.dtype)
        return orthogonalize(q.to(v.device, copy=True), self.epsilon)

    # -- the protocol --------------------------------------------------------------
    def launch(self, residuals, keys, name, comm):
        ex = Exchange(comm, name, residuals, keys)
        ex.matrices = [v.view(v.shape[0], -1) for v in residuals]
        ex.qs = [self._start_q(key, M.shape[1], self.effective_rank(M.shape), M)
                 for M, key in zip(ex.matrices, keys)]
        ps = [M @ q for M, q in zip(ex.matrices, ex.qs)]
        ex.handle = comm.allreduce_async(torch.cat([p.reshape(-1) for p in ps]), name + ".p", Sum)
        return ex

    def advance(self, ex):
        if ex.round != 1:
            return
        flat = ex.comm.wait(ex.handle)
        ex.ps, offset = [], 0
        for M, q in zip(ex.matrices, ex.qs):
            size = M.shape[0] * q.shape[1]
            ex.ps.append(orthogonalize(flat[offset:offset + size].view(M.shape[0], -1),
                                       self.epsilon))
            offset += size
        qs = [M.t() @ p for M, p in zip(ex.matrices, ex.ps)]
        ex.handle = ex.comm.allreduce_async(torch.cat([q.reshape(-1) for q in qs]),
                                            ex.name + ".q", Average)
        ex.round = 2

    def collect(self, ex):
        self.advance(ex)
        flat = ex.comm.wait(ex.handle)
        averages, offset = [], 0
        for M, p, key in zip(ex.matrices, ex.ps, ex.keys):
            size = M.shape[1] * p.shape[1]
            q = flat[offset:offset + size].view(M.shape[1], -1)
            offset += size
            if self.warm_start and bool(torch.isfinite(q).all()):  # an overflowed step keeps Q
                self._q[key] = q.clone()
            averages.append((p @ q.t()).reshape(-1))
        ex.sent = averages
        self.keep_residual(ex)
        return averages

    # -- checkpoint ------------------------------------------------------------------
    def state_dict(self):
        return {"q": {k: q.clone() for k, q in self._q.items()},
                "q_generators": {k: g.get_state() for k, g in self._q_gens.items()}}

    def load_state_dict(self, state, rank=0):
        self._q = {k: q.clone() for k, q in state.get("q", {}).items()}
        self._q_gens = {}
        for k, s in state.get("q_generators", {}).items():
            self._q_gens[k] = torch.Generator()
            self._q_gens[k].set_state(s)
