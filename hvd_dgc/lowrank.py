"""PowerSGD's options and plan, framework-free (Vogels et al., NeurIPS 2019): which
tensors it compresses, at what rank, and what they cost on the wire. The PyTorch and
TensorFlow compressors (hvd_dgc/torch/powersgd.py, hvd_dgc/tensorflow/powersgd.py)
share it, so both decide alike and refuse the same bad options with the same words.
"""

import math

__all__ = ["LowRankPlan"]


class LowRankPlan:
    """Mixin: ``rank``, ``start_iter``, ``min_rate``, ``warm_start``, ``epsilon`` (and the
    compressor's ``seed``), checked once; a tensor is viewed as shape[0] x the rest."""

    summable_why = ("it needs two allreduces per step (P, then Q computed from the "
                    "orthogonalised sum of P) and a per-tensor Q and residual, which "
                    "Horovod's one compress -> allreduce -> decompress per tensor cannot give")

    def _set_plan(self, rank, start_iter, min_rate, warm_start, epsilon):
        if not isinstance(rank, int) or rank < 1:
            raise ValueError(f"PowerSGD rank must be an int >= 1, got {rank!r}")
        if not isinstance(start_iter, int) or start_iter < 0:
            raise ValueError(f"PowerSGD start_iter must be an int >= 0, got {start_iter!r}")
        self.rank, self.start_iter, self.min_rate = rank, start_iter, float(min_rate)
        self.warm_start, self.epsilon = bool(warm_start), float(epsilon)

    def _options(self):
        return {"rank": self.rank, "start_iter": self.start_iter, "min_rate": self.min_rate,
                "warm_start": self.warm_start, "epsilon": self.epsilon, "seed": self.seed}

    @staticmethod
    def matrix_shape(shape):
        return int(shape[0]), math.prod(int(s) for s in shape[1:])

    def effective_rank(self, shape):
        n, m = self.matrix_shape(shape)
        return min(n, m, self.rank)

    def saves(self, shape):
        """Whether a tensor of ``shape`` is worth it: (n + m) r min_rate < n m (1-D never)."""
        if len(shape) < 2:
            return False
        n, m = self.matrix_shape(shape)
        return (n + m) * self.effective_rank(shape) * self.min_rate < n * m

    def wire_bytes(self, shape, world=1):
        """P and Q in float32."""
        n, m = self.matrix_shape(shape)
        return (n + m) * self.effective_rank(shape) * 4
