"""Runs of delayed averaging and ``period`` whose gradients do not depend on the weights
(``loss = sum(w * c)``), so every rank's weights can be written out from
tests/reference.py alone: the one reference both frameworks' workers (tf_dga.py,
torch_dga.py) are held to. NumPy only."""

import numpy as np

SHAPES = [(40, 32), (32,), (32, 8)]

#: delay="auto" runs both frameworks' tests make: name -> (start D, idle, period,
#: seconds of extra compute per step)
AUTO = {
    "down": (4, 0.99, 1, 0.02),   # every wait counts as none: D steps down to 1
    "up": (1, 0.0, 1, 0.0),       # every wait counts: D climbs to max_delay
    "up_period2": (1, 0.0, 2, 0.0),
}


def fixed_grads(step, rank, size=None, scale=1.0):
    """This rank's gradient at ``step`` (all ranks' when ``size`` is given)."""
    if size is not None:
        return [fixed_grads(step, r, scale=scale) for r in range(size)]
    rng = np.random.RandomState(7919 * step + rank)
    return [(rng.randn(*s) * scale).astype(np.float32) for s in SHAPES]


def period_reference(w0, size, steps, density, momentum, period, delay, lr=0.05):
    """Every rank's weights after each step, and after a flush, by tests/reference.py:
    the memory of a ``period`` run (lagged_memory_step: dense, or exact top-k at
    ``density`` with momentum masking), the update (lagged_update) and the flush
    (lagged_flush), with the fixed gradients of ``fixed_grads`` and SGD at ``lr``
    (momentum taken over by the memory). ``delay``: an int, or the D of each step."""
    import tests.reference as ref
    shapes = [x.shape for x in w0]
    mem = [[(np.zeros(int(np.prod(s)), np.float32),) * 2 for s in shapes] for _ in range(size)]
    owns = [[[] for _ in shapes] for _ in range(size)]   # [rank][tensor][step]
    avgs = [[] for _ in shapes]                          # [tensor][step]
    weights = [[x.astype(np.float32).copy() for x in w0] for _ in range(size)]
    per_step = []
    for i in range(steps):
        grads = fixed_grads(i, None, size)
        exchange = (i + 1) % period == 0
        for t, shape in enumerate(shapes):
            numel = int(np.prod(shape))
            k = None if density is None else ref.num_selected(numel, density)
            for r in range(size):
                u, v = mem[r][t]
                u, v, own = ref.lagged_memory_step(u, v, grads[r][t].reshape(-1), exchange, k,
                                                   momentum)
                mem[r][t] = (u, v)
                owns[r][t].append(own)
            avgs[t].append(ref.average([owns[r][t][i] for r in range(size)]) if exchange
                           else None)
        for r in range(size):
            for t, shape in enumerate(shapes):
                update = ref.lagged_update(owns[r][t], avgs[t], i, delay, period)
                weights[r][t] = weights[r][t] - np.float32(lr) * update.reshape(shape)
        per_step.append([[w.copy() for w in ws] for ws in weights])
    flushed = [[w - np.float32(lr) * ref.lagged_flush(owns[r][t], avgs[t], steps, delay,
                                                       period).reshape(w.shape)
                for t, w in enumerate(weights[r])] for r in range(size)]
    return per_step, flushed
