"""A framework-free NumPy reference of DGC's per-tensor maths, for the parity tests.

Why: hvd_dgc implements the same maths twice (hvd_dgc/torch/memory.py and
hvd_dgc/tensorflow/memory.py, plus a C++ kernel); checking each against the other
would let a shared mistake through. This module states the maths once, as the
papers write it, in plain float32 NumPy, and tests/core/test_reference.py checks it
against hand-derived vectors and then each framework against it.

Papers:
  [DGC] Lin, Han, Mao, Wang, Dally, "Deep Gradient Compression: Reducing the
        Communication Bandwidth for Distributed Training", ICLR 2018.
        Sec. 3.1 gradient sparsification (send the largest |v|, keep the rest
        locally); Sec. 3.2 momentum correction (Eq. 5-6: accumulate the velocity
        u, not the gradient) and momentum factor masking; Sec. 3.3 local gradient
        clipping (each of N workers clips at clip_norm / sqrt(N)).
  [DGA] Zhu, Lin, Lu, Han, "Delayed Gradient Averaging: Tolerate the
        Communication Latency for Federated Learning", NeurIPS 2021:
        update_i = own_i - own_(i-D) + avg_(i-D).
  [TSU] Zhu, Lin, Han, "Distributed Training Across the World", 2019: temporally
        sparse updates, an exchange every p-th step, own steps in between.
  [01A] Lu, Li, Zhang, He, "Maximizing Communication Efficiency for Large-scale
        Training via 0/1 Adam", ICLR 2023: Adam's frozen variance refreshed at rare
        steps every rank agrees on.
  [EF-SignSGD] Karimireddy, Rebjock, Stich, Jaggi, "Error Feedback Fixes SignSGD and
        other Gradient Compression Schemes", ICML 2019: the scaled sign of what the
        memory holds, the rest kept; with Adam's variance frozen, 1-bit Adam (Tang et
        al., ICML 2021).

Every function computes in float32 (the frameworks' buffer dtype), in the order
written in its docstring, so where a framework does the same operations in the same
order the results agree bit for bit. Functions return new arrays; they never modify
their arguments.
"""

import math
import zlib
from typing import List, NamedTuple, Optional, Sequence

import numpy as np

F32 = np.float32
EPS = F32(1e-6)  # added to the norm before dividing (both frameworks' local_gradient)


def f32(x):
    """A flat float32 copy."""
    return np.array(x, dtype=F32).reshape(-1)


# -- DGC Sec. 3.3: local gradient clipping ---------------------------------------------
def clip_scale(g, clip_norm, world=1):
    """min(1, (clip_norm / sqrt(N)) / (||g|| + 1e-6)) in float32: each worker holds 1/N
    of the summed gradient's variance, so the global threshold shrinks by N^-1/2 [DGC 3.3].
    ||g|| is summed pairwise (NumPy), so it may differ from a framework's in the last bit."""
    g = f32(g)
    limit = F32(clip_norm / math.sqrt(world))  # the frameworks: a Python float, then float32
    norm = np.sqrt(np.sum(g * g, dtype=F32))
    return min(F32(1.0), limit / (norm + EPS))


def local_gradient(g, clip_norm=None, world=1, weight_decay=0.0, param=None):
    """The gradient a worker feeds into its memory: flat float32, clipped per tensor when
    ``clip_norm`` is given, then ``+ weight_decay * param`` (the PyTorch side folds SGD's
    weight decay in after clipping, as clip_grad_norm_ then SGD(weight_decay) would;
    TensorFlow's local_gradient has no weight decay)."""
    g = f32(g)
    if clip_norm is not None:
        g = g * clip_scale(g, clip_norm, world)
    if weight_decay:
        g = g + F32(weight_decay) * f32(param)
    return g


# -- DGC Sec. 3.2: momentum correction, error feedback -------------------------------
def accumulate(u, v, g, momentum=0.0, nesterov=False):
    """Fold one gradient into the memory; returns (u, v).

    Momentum correction [DGC Eq. 5-6] accumulates the velocity, so momentum survives
    sparsification:  u = m u + g;  v = v + u.  Nesterov:  u = m (u + g);  v = v + (u + g).
    Momentum 0 is plain error feedback:  v = v + g  (u unchanged).
    """
    u, v, g = f32(u), f32(v), f32(g)
    if not momentum:
        return u, v + g
    m = F32(momentum)
    if nesterov:
        u = m * (u + g)
        return u, v + (u + g)
    u = m * u + g
    return u, v + u


def sent(u, v, indices, masking=True):
    """The coordinates at ``indices`` left (sparse path): they leave v; with momentum factor
    masking [DGC 3.2] their momentum goes too (it would keep pushing a coordinate whose
    accumulated value was just applied). Returns (u, v)."""
    u, v = f32(u), f32(v)
    v[indices] = 0
    if masking:
        u[indices] = 0
    return u, v


def sent_all(u, v):
    """Dense path: every coordinate left, so v clears and u is kept: nothing is stale, and
    masking here would turn momentum SGD into plain SGD. Returns (u, v)."""
    return f32(u), np.zeros_like(f32(v))


# -- DGC Sec. 3.1: sparsification -------------------------------------------------------
def draw(seed, rank, step, key):
    """The sampling draw every rank and process computes alike, as written in Python
    integers (splitmix64 of the four coordinates; a name ``key`` by its CRC-32): a
    uniform number in [0, 1). hvd_dgc computes it in NumPy's wrapping uint64
    (hvd_dgc/torch/cpu_select.py ``draws``), for every tensor of a launch at once."""
    mask = (1 << 64) - 1
    key = key if isinstance(key, int) else zlib.crc32(str(key).encode())
    x = (seed * 0x9E3779B97F4A7C15 + rank * 0xBF58476D1CE4E5B9 + step * 0x94D049BB133111EB
         + key) & mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    x ^= x >> 31
    return (x >> 11) / float(1 << 53)


def num_selected(numel, density):
    """k = ceil(numel * density), at least 1 and at most numel (hvd_dgc/schedule.py)."""
    return max(1, min(numel, int(math.ceil(numel * density))))


def top_k(v, k):
    """Indices of the k largest |v|, largest first. Ties go to the lower index (a stable
    sort); the frameworks' top-k may break ties otherwise, so test vectors avoid ties."""
    return np.argsort(-np.abs(f32(v)), kind="stable")[:k]


def dgc_adapt(flat, k, threshold, window=(0.8, 1.3), decay=0.8, rounds=10):
    """DGC's selection from a first ``threshold`` (the sampled estimate of the magnitude
    ``window[1] * k`` entries pass; [DGC] Sec. 3.1 and the window and rounds of its
    reference code), the rule both frameworks follow: the coordinates with |v| >= t;
    more than k: the exact top-k of those; fewer than window[0] * k: lower t by
    ``decay`` and look again, at most ``rounds`` times, then the exact top-k of the whole
    tensor. Never more than k records: an exact top-k's bytes. Sorted indices; t stays
    in float32, as in the frameworks."""
    magnitude = np.abs(f32(flat))
    low, t = window[0] * k, F32(threshold)
    for _ in range(rounds + 1):
        candidates = np.flatnonzero(magnitude >= t)
        if candidates.size > k:
            return np.sort(candidates[np.argsort(-magnitude[candidates], kind="stable")[:k]])
        if candidates.size >= low:
            return candidates
        t = F32(t * F32(decay))
    return np.sort(top_k(magnitude, k))


def scatter(indices, values, numel):
    """The dense tensor a worker's records stand for (zeros elsewhere)."""
    out = np.zeros(numel, F32)
    out[indices] = values
    return out


# -- one tensor through several steps ----------------------------------------------------
class Record(NamedTuple):
    """One step of one tensor: what was sent, and the memory after sending it."""
    indices: np.ndarray  # sent coordinates, largest |v| first
    values: np.ndarray   # v at those coordinates (what goes on the wire)
    u: np.ndarray        # velocity after the step (zeros without momentum)
    v: np.ndarray        # residual after the step


def step(u, v, g, k, momentum=0.0, nesterov=False, masking=True):
    """accumulate, select the top k, sent: one step of the sparse path -> (Record)."""
    u, v = accumulate(u, v, g, momentum, nesterov)
    idx = top_k(v, k)
    values = v[idx].copy()
    u, v = sent(u, v, idx, masking)
    return Record(idx, values, u, v)


def run(grads: Sequence, k, momentum=0.0, nesterov=False, masking=True, clip_norm=None,
        world=1) -> List[Record]:
    """One tensor's memory through ``len(grads)`` steps from zeros; a Record per step."""
    numel = f32(grads[0]).size
    u, v, out = np.zeros(numel, F32), np.zeros(numel, F32), []
    for g in grads:
        rec = step(u, v, local_gradient(g, clip_norm, world), k, momentum, nesterov, masking)
        u, v = rec.u, rec.v
        out.append(rec)
    return out


# -- [DGA] delayed gradient averaging ---------------------------------------------------
def dga_update(own_history, avg_history, i, delay):
    """What a worker applies at step i with delay D [DGA]: its own contribution now, and
    the average of step i-D replacing its own part of that step:
        update_i = own_i - own_(i-D) + avg_(i-D)      (own_i alone while i < D).
    Summed over steps it telescopes: every step's average, except the last D steps, for
    which the worker's own contribution stands in until they arrive (flush)."""
    own_i = f32(own_history[i])
    if i < delay:
        return own_i
    return own_i - f32(own_history[i - delay]) + f32(avg_history[i - delay])


# -- [TSU] temporally sparse updates (period), with [DGA] ------------------------------
def lag_due(steps, delay, period):
    """{exchange step s: the step that applies its average}: every period-th step
    exchanges ((s + 1) % p == 0), applied D steps later (hvd_dgc/lagging.py). ``delay``
    may be a list, the D in force at each step (delay="auto"): an exchange takes the D
    its period began with, and is applied no earlier than the one before it."""
    delays = list(delay) if isinstance(delay, (list, tuple)) else [delay] * steps
    due, last = {}, -1
    for s in range(period - 1, steps, period):
        due[s] = last = max(s + delays[s - period + 1], last)
    return due


def take_back(then, now):
    """[hvd_dgc/lagging.py] The factor on a due entry's correction: ``then`` and ``now``
    are (rate, log_decay) of the entry's step and of the step that applies it (the rate
    the optimizer multiplies its update by; the sum of log(1 - lr wd) of the decoupled
    decays so far): rate_s / rate_t * prod_{s < j <= t} (1 - lr_j wd), so that an own
    step applied at its rate, and decayed since, leaves exactly. 1 where unknown, or the
    rate now is 0."""
    if then is None or now is None or not now[0]:
        return 1.0
    return then[0] / now[0] * math.exp(now[1] - then[1])


def _period_correction(owns, avgs, s, period, now, sizes):
    """What exchange ``s`` adds to the step that applies it (size ``now``): avg_s - own_s
    and -own_j of its period's earlier steps, each times its ``take_back`` (one sum of
    the period's own steps where ``sizes`` is None: every step's size the same)."""
    if sizes is None:
        took = sum(f32(owns[j]) for j in range(s - period + 1, s + 1))
        return f32(avgs[s]) - took
    out = np.zeros_like(f32(owns[s]))
    for j in range(s - period + 1, s):
        out = out - F32(take_back(sizes[j], now)) * f32(owns[j])
    return out + F32(take_back(sizes[s], now)) * (f32(avgs[s]) - f32(owns[s]))


def lagged_update(owns, avgs, i, delay, period, sizes=None):
    """What a worker applies at step i with period p and delay D [TSU, DGA]: its own
    contribution now (an exchange's: what it sent; a step between exchanges: what its
    memory took in), and every exchange s applied now (s + D == i) in place of its
    period's own steps:
        update_i = own_i + sum over s (avg_s - sum_{j = s-p+1 .. s} own_j).
    ``owns[j]``: this worker's own at step j; ``avgs[j]``: the average (None between
    exchanges). At p = 1 this is ``dga_update``. ``sizes[j]``: (rate, log_decay) of step
    j, each entry's correction times its ``take_back`` (None: all alike)."""
    update = f32(owns[i]).copy()
    for s, at in lag_due(i + 1, delay, period).items():
        if at == i:
            update = update + _period_correction(owns, avgs, s, period,
                                                 None if sizes is None else sizes[i], sizes)
    return update


def lagged_flush(owns, avgs, steps, delay, period, sizes=None, now=None):
    """What a flush after ``steps`` steps applies: the exchanges not applied yet, and
    ``-own`` of the steps after the last exchange (their velocity is still in the
    memory, to be sent later); with ``sizes``, each times its ``take_back`` against the
    flush's ``now``."""
    out = np.zeros_like(f32(owns[0]))
    exchanges = lag_due(steps, delay, period)
    for s, at in exchanges.items():
        if at >= steps:
            out = out + _period_correction(owns, avgs, s, period, now, sizes)
    last = max(exchanges, default=-1)
    for j in range(last + 1, steps):
        factor = 1.0 if sizes is None else take_back(sizes[j], now)
        out = out - F32(factor) * f32(owns[j])
    return out


def sign_sent(v):
    """What ``Compression.sign`` sends of v [EF-SignSGD]: the mean |v| times the sign of
    each element (0 counts as +), float32; error feedback keeps ``v - sign_sent(v)``."""
    v = f32(v)
    scale = np.mean(np.abs(v), dtype=F32)
    return np.where(v >= 0, scale, -scale).astype(F32)


def lagged_memory_step(u, v, g, exchange, k=None, momentum=0.0, masking=True,
                       compress=None):
    """One worker's memory at a step of a ``period`` run: accumulate [DGC 3.2]; an
    exchange sends v's top k (all of v when ``k`` is None: dense; ``compress(v)`` when
    given, e.g. ``sign_sent``, the rest kept: error feedback, the momentum unmasked) and
    its own is what it sent; a step between exchanges sends nothing and its own is what
    v took in (u, or g without momentum). Returns (u, v, own)."""
    u, v = accumulate(u, v, g, momentum)
    if not exchange:
        return u, v, (u if momentum else f32(g)).copy()
    if compress is not None:
        own = compress(v)
        return u, v - own, own
    if k is None:
        own = v.copy()
        u, v = sent_all(u, v)
        return u, v, own
    idx = top_k(v, k)
    own = scatter(idx, v[idx], v.size)
    u, v = sent(u, v, idx, masking)
    return u, v, own


# -- skip_nonfinite ----------------------------------------------------------------------
class Memory(NamedTuple):
    """One rank's memory of one tensor."""
    u: np.ndarray
    v: np.ndarray


class GuardedStep(NamedTuple):
    """Every rank's memory after a step, what each rank sent (None: the step was skipped
    everywhere) and whether it was skipped."""
    memories: List[Memory]
    owns: Optional[List[np.ndarray]]
    skipped: bool


def nonfinite_sync_step(memories: Sequence[Memory], grads, k, momentum=0.0, nesterov=False,
                        masking=True, delay=0) -> GuardedStep:
    """One step of every rank with skip_nonfinite. A NaN/Inf must never enter a memory:
    it would stay there (error feedback keeps what is not sent) and come out later.

    delay == 0: one rank's non-finite gradient skips the step on every rank: memories
    (u, v) and the step unchanged, nothing applied.
    delay > 0: the other ranks have applied their own part of this step already [DGA],
    so the step cannot be undone: the rank that has it keeps it out of its memory (u and v
    unchanged) and sends zeros (own = 0); the others step as usual.
    """
    finite = [bool(np.all(np.isfinite(f32(g)))) for g in grads]
    if delay == 0 and not all(finite):
        return GuardedStep(list(memories), None, True)
    out, owns = [], []
    for mem, g, ok in zip(memories, grads, finite):
        if not ok:
            out.append(mem)
            owns.append(np.zeros_like(f32(mem.v)))
            continue
        rec = step(mem.u, mem.v, g, k, momentum, nesterov, masking)
        out.append(Memory(rec.u, rec.v))
        owns.append(scatter(rec.indices, rec.values, rec.v.size))
    return GuardedStep(out, owns, False)


def average(owns):
    """The average of every rank's contribution (float32, summed in rank order)."""
    total = np.zeros_like(f32(owns[0]))
    for own in owns:
        total = total + f32(own)
    return total / F32(len(owns))


# -- [1-bit Adam] Adam with its second moment frozen -------------------------------------
# Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with Adam's
# Convergence Speed", ICML 2021: exact Adam for a warm-up, then v frozen, so the update
# is momentum SGD with a fixed preconditioner P (hvd_dgc/adam.py). x, m, v float32.
def adam(x, m, v, g, t, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
         decoupled=False):
    """torch.optim.Adam's (``decoupled``: AdamW's) step number t (1-based) on the averaged
    gradient g; returns (x, m, v)."""
    x, m, v, g = f32(x), f32(m), f32(v), f32(g)
    b1, b2 = F32(betas[0]), F32(betas[1])
    if decoupled:
        x = x * F32(1.0 - lr * weight_decay)
    elif weight_decay:
        g = g + F32(weight_decay) * x
    m = b1 * m + (F32(1) - b1) * g
    v = b2 * v + (F32(1) - b2) * g * g
    denom = np.sqrt(v) / F32(math.sqrt(1.0 - betas[1] ** t)) + F32(eps)
    return x - F32(lr / (1.0 - betas[0] ** t)) * (m / denom), m, v


def keras_adam(x, m, v, g, t, lr, betas=(0.9, 0.999), eps=1e-7, weight_decay=0.0):
    """Keras' Adam (with ``weight_decay``: AdamW; Keras decays every optimizer's weights
    decoupled, before the step) step number t (1-based) on the averaged gradient g;
    returns (x, m, v). Keras adds eps outside the bias correction:
    x -= lr sqrt(1 - beta2^t) / (1 - beta1^t) * m / (sqrt(v) + eps)."""
    x, m, v, g = f32(x), f32(m), f32(v), f32(g)
    b1, b2 = F32(betas[0]), F32(betas[1])
    if weight_decay:
        x = x - x * F32(weight_decay) * F32(lr)
    m = m + (g - m) * (F32(1) - b1)
    v = v + (g * g - v) * (F32(1) - b2)
    alpha = F32(lr * math.sqrt(1.0 - betas[1] ** t) / (1.0 - betas[0] ** t))
    return x - m * alpha / (np.sqrt(v) + F32(eps)), m, v


def frozen_precondition(v, t, betas=(0.9, 0.999), eps=1e-8, floor=0.0, keras=False):
    """P = 1 / (sqrt(v / (1 - beta2^t)) + eps): the bias-corrected v of step t, frozen,
    v first floored at ``floor`` times its mean (hvd_dgc/adam.py VARIANCE_FLOOR).
    ``keras``: Keras' eps, outside the bias correction, as it stood at step t:
    P = 1 / (sqrt(v / (1 - beta2^t)) + eps / sqrt(1 - beta2^t))."""
    v = f32(v)
    v = np.maximum(v, F32(np.mean(v, dtype=F32) * F32(floor)))
    root = F32(math.sqrt(1.0 - betas[1] ** t))
    return F32(1) / (np.sqrt(v) / root + (F32(eps) / root if keras else F32(eps)))


def frozen_adam_gradient(g, precondition, beta1, weight_decay=0.0, param=None):
    """What enters DGC's memory: (1 - beta1) P (g + wd x), wd Adam's L2 decay (AdamW: 0)."""
    g = f32(g)
    if weight_decay:
        g = g + F32(weight_decay) * f32(param)
    return F32(1.0 - beta1) * f32(precondition) * g


def frozen_adam_apply(x, average, t, lr, beta1, decoupled_decay=0.0):
    """Step t (1-based, Adam's count) from the average of what the ranks sent:
    x (1 - lr wd) - lr / (1 - beta1^t) * average."""
    x = f32(x)
    if decoupled_decay:
        x = x * F32(1.0 - lr * decoupled_decay)
    return x - F32(lr / (1.0 - beta1 ** t)) * f32(average)


# -- the outer loop (hvd_dgc/outer.py) -------------------------------------------------------
def outer_targets(step, rank):
    """The quadratic both frameworks' outer-loop tests pull a (40, 50) and a (30,) tensor
    towards, per rank and step: the gradient is ``x - T``, so a run replays in NumPy."""
    rng = np.random.RandomState(1000 * rank + step)
    return rng.randn(40, 50).astype(np.float32), rng.randn(30).astype(np.float32)


#: The quadratic runs both frameworks' workers make and tests/torch/test_outer.py replays, by
#: name: (inner SGD steps at lr 0.1, ``OuterLoop(steps=3, lr=0.7, momentum=0.9,
#: nesterov=True)``'s fields changed, the wrapper's options, each tensor's k for the
#: replay: None when the change is sent whole).
OUTER_RUNS = {
    "dense": (10, {}, {}, None),
    "sparse": (10, {}, {"density": 0.1, "min_compress_size": 100}, [200, 30]),
    "heavy_ball": (9, {"nesterov": False}, {"density": 0.25, "min_compress_size": 100},
                   [500, 30]),
    "overlap": (10, {"overlap": True}, {}, None),
    "overlap_sparse": (9, {"overlap": True}, {"density": 0.1, "min_compress_size": 100},
                       [200, 30]),
    # SparseLoCo's shape: no outer momentum, the residual decayed each round (0.5 here,
    # so that a framework which ignored it would be far off)
    "decayed_residual": (9, {"overlap": True, "lr": 1.0, "momentum": 0.0,
                             "nesterov": False, "residual_decay": 0.5},
                         {"density": 0.1, "min_compress_size": 100}, [200, 30]),
    # values in 2 bits (a sign and lo or hi per tensor): the rounding stays owed
    "two_bit_values": (9, {"value_bits": 2}, {"density": 0.1, "min_compress_size": 100},
                       [200, 30]),
}


def low_bit(values, bits):
    """A tensor's sent values as they arrive in ``bits`` (hvd_dgc/outer.py RecordLayout):
    a sign and the nearest of 2 ** (bits - 1) levels from the smallest to the largest
    magnitude."""
    values = f32(values)
    if bits == 32:
        return values
    mags = np.abs(values)
    lo, hi = mags.min(), mags.max()
    step = (hi - lo) / F32((1 << (bits - 1)) - 1)
    level = np.round((mags - lo) / step) if step > 0 else np.zeros_like(mags)
    arrived = lo + level.astype(np.float32) * step
    return np.where(values < 0, -arrived, arrived).astype(np.float32)


def outer_average(deltas, residuals, sizes, ks=None, decay=1.0, value_bits=32):
    """Every rank's pseudo-gradient ``deltas[r]`` (flat) averaged as the outer loop sends
    it: whole (``ks`` None), or per tensor (``sizes``) the ``ks`` largest
    ``|decay * residual + delta|`` as records, their values as ``low_bit`` sends them,
    what was not sent (and the values' rounding) kept in ``residuals[r]`` (updated in
    place). Returns the average."""
    world = len(deltas)
    if ks is None:
        return sum(f32(d) for d in deltas) / F32(world)
    total = np.zeros_like(f32(deltas[0]))
    for r, delta in enumerate(deltas):
        v = residuals[r]
        if decay != 1:
            v *= F32(decay)
        v += f32(delta)
        offset = 0
        for numel, k in zip(sizes, ks):
            part = v[offset:offset + numel]
            chosen = np.arange(numel) if k >= numel else np.argsort(-np.abs(part))[:k]
            arrived = low_bit(part[chosen], value_bits)
            total[offset + chosen] += arrived
            part[chosen] -= arrived
            offset += numel
    return total / F32(world)


def outer_update(anchor, average, buffer, lr, momentum=0.0, nesterov=False):
    """The outer step: ``(anchor, buffer)`` after it (buffer None before the first round
    and with momentum 0)."""
    anchor, average = f32(anchor), f32(average)
    if not momentum:
        return anchor - F32(lr) * average, None
    buffer = average if buffer is None else f32(buffer) * F32(momentum) + average
    step = average + buffer * F32(momentum) if nesterov else buffer
    return anchor - F32(lr) * step, buffer


def observed_square(g, previous, world):
    """What a rank's tracked second moment moves towards after the freeze [01A]: its
    own ``g^2`` reads the average gradient's noise ``world`` times too large, and the
    noise of two steps is independent, so ``g^2 / world + (1 - 1/world) g g_previous``
    averaged over the ranks estimates the square of their average gradient."""
    g, previous = f32(g), f32(previous)
    return F32(1.0 / world) * g * g + F32(1.0 - 1.0 / world) * g * previous


def refreshed_precondition(local_vs, old, t, betas, eps, floor, keras=False):
    """0/1 Adam's refresh [01A] of a precondition ``old`` at the end of Adam's step t:
    the ranks' own second moments averaged (every rank goes on from it), P from it
    (``frozen_precondition``), and the ratio ``(1 - beta1) P / ((1 - beta1) old)`` that
    the memory's momentum and residual are multiplied by. Returns (average, P, ratio)."""
    average_v = np.maximum(average(local_vs), F32(0.0))  # (observed_square can be < 0)
    new = frozen_precondition(average_v, t, betas, eps, floor, keras=keras)
    scale = F32(1.0 - betas[0])
    return average_v, new, (scale * new) / (scale * f32(old))


def delayed_frozen_adam(start, grads_at, steps, world, freeze, lr, betas, eps, wd, delay,
                        floor, keras=False, period=1, refresh=(), compress=None):
    """Adam taken over with delayed averaging [1-bit Adam] [DGA], dense: the reference
    both frameworks' are held to. Synchronous exact Adam on the ranks' average to the
    freeze; then each rank's memory takes (1 - beta1) P g at momentum beta1 and sends it
    whole (its own), and the rank applies ``own_i - own_(i-D) + avg_(i-D)`` (own alone
    while i - D is before the freeze), its gradients ``grads_at(x, step, rank)`` taken at
    its own weights x. ``keras``: Keras' Adam (eps outside the bias correction) and
    decoupled decay before the step; else torch's AdamW. ``period`` [TSU]: after the
    freeze every period-th step exchanges (what the memory holds, all of it) and the
    steps between apply what the memory took in (``lagged_update``), each own step
    taken back at its step's size (``take_back``: lr / (1 - beta1^t), and AdamW's
    decay since). Returns per rank
    the weights (per tensor) after each step, and every rank's after the flush: the
    corrections still due (``lagged_flush``), at Adam's count then and without decay,
    then the ranks' average. ``refresh``: Adam's steps t at whose end the variance is
    refreshed: from the freeze each rank's own v moves on with its own gradients
    (``observed_square``; in Keras' form ``v + (s - v)(1 - beta2)`` with ``keras``), and
    ``refreshed_precondition`` replaces P and rescales the memory. ``compress``: per
    tensor, what an exchange sends of the memory (``lagged_memory_step``; None: all of
    it), as a compressor of its own collectives does after the freeze (sign: 1-bit Adam
    itself [1-bit Adam]); before the freeze every tensor goes dense."""
    x = [[f32(a).copy() for a in start] for _ in range(world)]
    compress = compress or [None] * len(start)
    n = len(start)
    m, v = [np.zeros_like(a) for a in x[0]], [np.zeros_like(a) for a in x[0]]
    owns, avgs, out = [[] for _ in range(world)], [], [[] for _ in range(world)]
    sizes, log_decay = [], 0.0  # (rate, log_decay) of each step (take_back)
    for step in range(steps):
        t = step + 1
        if step >= freeze and wd:  # the frozen step's AdamW decay (both forms)
            log_decay += math.log1p(-lr * wd)
        sizes.append((lr / (1.0 - betas[0] ** t), log_decay))
        grads = [grads_at(x[r], step, r) for r in range(world)]
        if step < freeze:
            avg = [average([g[i] for g in grads]) for i in range(n)]
            for i in range(n):
                x[0][i], m[i], v[i] = keras_adam(x[0][i], m[i], v[i], avg[i], t, lr, betas,
                                                 eps, wd) if keras else \
                    adam(x[0][i], m[i], v[i], avg[i], t, lr, betas, eps, wd, True)
            x = [[a.copy() for a in x[0]] for _ in range(world)]
            if t == freeze:
                pre = [frozen_precondition(v[i], t, betas, eps, floor, keras=keras)
                       for i in range(n)]
                u = [[pre[i] * m[i] for i in range(n)] for _ in range(world)]
                res = [[np.zeros_like(a) for a in x[0]] for _ in range(world)]
                local_v = [[v[i].copy() for i in range(n)] for _ in range(world)]
                previous = [[np.zeros_like(a) for a in x[0]] for _ in range(world)]
            owns_now = [[np.zeros_like(a) for a in x[0]] for _ in range(world)]
        else:
            owns_now = [[None] * n for _ in range(world)]
            exchange = (step + 1) % period == 0
            for r in range(world):
                for i in range(n):
                    g = f32(grads[r][i])
                    seen = observed_square(g, previous[r][i], world)
                    previous[r][i] = g
                    local_v[r][i] = local_v[r][i] + (seen - local_v[r][i]) * \
                        F32(1.0 - betas[1]) if keras else \
                        F32(betas[1]) * local_v[r][i] + F32(1.0 - betas[1]) * seen
                    g = frozen_adam_gradient(grads[r][i], pre[i], betas[0])
                    u[r][i], res[r][i], owns_now[r][i] = lagged_memory_step(
                        u[r][i], res[r][i], g, exchange, momentum=betas[0],
                        compress=compress[i])
        avgs.append([average([own[i] for own in owns_now]) for i in range(n)])
        for r in range(world):
            owns[r].append(owns_now[r])
            if step >= freeze:  # (the warm-up's steps, never delayed, hold zeros)
                for i in range(n):
                    update = lagged_update([o[i] for o in owns[r]], [a[i] for a in avgs],
                                           step, delay, period, sizes)
                    if keras and wd:
                        x[r][i] = x[r][i] - x[r][i] * F32(wd) * F32(lr)
                    x[r][i] = frozen_adam_apply(x[r][i], update, t, lr, betas[0],
                                                0.0 if keras else wd)
            out[r].append([a.copy() for a in x[r]])
        if t in refresh:
            for i in range(n):
                mean_v, pre[i], ratio = refreshed_precondition(
                    [local_v[r][i] for r in range(world)], pre[i], t, betas, eps, floor,
                    keras=keras)
                for r in range(world):
                    local_v[r][i] = mean_v.copy()
                    u[r][i], res[r][i] = u[r][i] * ratio, res[r][i] * ratio
    for r in range(world):
        for i in range(n):
            due = lagged_flush([o[i] for o in owns[r]], [a[i] for a in avgs], steps, delay,
                               period, sizes, (lr / (1.0 - betas[0] ** steps), log_decay))
            x[r][i] = frozen_adam_apply(x[r][i], due, steps, lr, betas[0])
    flushed = [np.mean([x[r][i] for r in range(world)], axis=0, dtype=F32) for i in range(n)]
    return out, flushed


# -- positions coded near their information content (hvd_dgc/packing.py) ----------------
def fp8_values(values, tensor, tensors):
    """Values in 8 bits as the allgather sends them (hvd_dgc/packing.py), ``tensor``
    naming each one's tensor (0 .. tensors - 1): each tensor's scale is its largest finite
    magnitude / 448 (1 where it has none), a value's code the float8 e4m3 nearest to
    value / scale (ties to even), NaN where the value is not finite. Returns ``(codes as
    uint8, scales, each value as it arrives)``."""
    import ml_dtypes
    values, tensor = f32(values), np.asarray(tensor, np.int64)
    finite = np.isfinite(values)
    magnitudes = np.where(finite, np.abs(values), F32(0)).astype(np.float32)
    largest = np.zeros(tensors, np.float32)
    np.maximum.at(largest, tensor, magnitudes)
    scales = np.where(largest > 0, largest / F32(448), F32(1)).astype(np.float32)
    with np.errstate(invalid="ignore"):
        scaled = np.where(finite, values / scales[tensor], np.nan).astype(np.float32)
    codes = scaled.astype(ml_dtypes.float8_e4m3fn)
    return codes.view(np.uint8), scales, codes.astype(np.float32) * scales[tensor]


def encode_positions(positions, n, code=None):
    """``positions`` (sorted, distinct, in 0..n-1) as uint8 bytes in ``code`` ("bitmap"
    or "elias-fano"; default: the smaller, hvd_dgc/packing.py ``index_code``). Both are
    one bit stream, least significant bit first."""
    from hvd_dgc.packing import elias_fano_low_bits, index_code
    p = np.asarray(positions, np.int64)
    k = len(p)
    code = code or index_code(n, k)
    if code == "bitmap":
        bits = np.zeros((n + 7) // 8 * 8, np.uint8)
        bits[p] = 1
        return np.packbits(bits, bitorder="little")
    low = elias_fano_low_bits(n, k)
    lows = ((p[:, None] >> np.arange(low)) & 1).reshape(-1)  # position i's at [i L, ..)
    high = np.zeros(k + ((n - 1) >> low) + 1, np.uint8)
    high[(p >> low) + np.arange(k)] = 1
    bits = np.concatenate([lows.astype(np.uint8), high])
    return np.packbits(np.pad(bits, (0, -len(bits) % 8)), bitorder="little")


def decode_positions(blob, n, k, code=None):
    """Inverse of ``encode_positions``: the k sorted positions."""
    from hvd_dgc.packing import elias_fano_low_bits, index_code
    bits = np.unpackbits(np.asarray(blob, np.uint8), bitorder="little").astype(np.int64)
    code = code or index_code(n, k)
    if code == "bitmap":
        return np.flatnonzero(bits[:n])
    low = elias_fano_low_bits(n, k)
    lows = (bits[:k * low].reshape(k, low) << np.arange(low)).sum(1)
    ones = np.flatnonzero(bits[k * low:])[:k]
    return ((ones - np.arange(k)) << low) | lows


# -- the sign's compressed allreduce (1-bit Adam's; hvd_dgc/packing.py sign_chunk_bytes) --
def sign_chunk(x, length, segments=None, width=1):
    """One chunk as the compressed allreduce sends it: a scale per segment (``segments``:
    their lengths, in order; None: one), mean |x| over it (summed in float64, then
    float32; 0 where empty), as ``width`` float32s (zeros past the segments), then its
    signs (x >= 0: 1), one bit each, least significant first, padded with 1 bits to
    ``length``. Returns ``(payload bytes, the chunk as it arrives: its segment's scale
    where the bit is 1, minus it where 0)``."""
    x = f32(x)
    segments = [x.size] if segments is None else list(segments)
    scales, each, at = np.zeros(width, np.float32), [], 0
    for j, n in enumerate(segments):
        part = x[at:at + n]
        scales[j] = np.float32(np.abs(part).astype(np.float64).sum() / n) if n else F32(0)
        each.append(np.full(n, scales[j], np.float32))
        at += n
    each = np.concatenate(each) if each else np.zeros(0, np.float32)
    bits = np.ones(length, np.uint8)
    bits[:x.size] = x >= 0
    payload = np.concatenate([scales.view(np.uint8), np.packbits(bits, bitorder="little")])
    return payload, np.where(x >= 0, each, -each).astype(np.float32)


def sign_reduce(inputs, server_errors=None):
    """The compressed allreduce of one group of tensors, every rank's part at once: rank
    i's ``inputs[i]`` (its memories, error feedback included: a list of arrays, or one
    array) one after the other in N chunks (hvd_dgc.aggregation.slices of the whole),
    chunk c signed with a scale per tensor it holds part of (every chunk as many as the
    chunk holding most: ``chunk_spans``) and sent to rank c; rank c averages the N
    chunks it got (summed in float64 in rank order, divided by N, then float32), adds
    its ``server_errors[c]`` (None: zeros), signs the result again and sends it to every
    rank, keeping what that lost as its new server error. Returns ``(average, sent,
    server_errors, payloads)``, flat over the group: the average every rank decodes,
    what each rank's own chunks decoded to (its error feedback takes it out of its
    memory), the new server errors (per owner, over its chunk), and ``payloads[i]``:
    rank i's bytes to each owner, then its re-signed chunk."""
    from hvd_dgc.aggregation import chunk_spans, slices
    group = [[f32(t) for t in x] if isinstance(x, (list, tuple)) else [f32(x)]
             for x in inputs]
    world, numels = len(inputs), [t.size for t in group[0]]
    flats = [np.concatenate(g) for g in group]
    n = int(sum(numels))
    bounds, spans = slices(n, world), chunk_spans(numels, world)
    width = max(1, max(len(s) for s in spans))
    length = max(1, -(-n // world))
    segments = [[hi - lo for _, lo, hi in chunk] for chunk in spans]
    errors = [np.zeros(hi - lo, np.float32) for lo, hi in bounds] if server_errors is None \
        else [f32(e) for e in server_errors]
    coded = [[sign_chunk(x[lo:hi], length, segments[c], width)
              for c, (lo, hi) in enumerate(bounds)] for x in flats]
    sent = [np.concatenate([d for _, d in row]) for row in coded]
    average, new_errors, payloads = [], [], []
    for c, (lo, hi) in enumerate(bounds):
        total = np.zeros(hi - lo, np.float64)
        for i in range(world):
            total += coded[i][c][1]
        w = (total / world).astype(np.float32) + errors[c]
        payload, arrived = sign_chunk(w, length, segments[c], width)
        average.append(arrived)
        new_errors.append((w - arrived).astype(np.float32))
        payloads.append(payload)
    to_owners = [[p for p, _ in row] for row in coded]
    return (np.concatenate(average), sent, new_errors,
            [(to_owners[i], payloads[i]) for i in range(world)])


#: the tensors of tests/core/test_sign_reduce.py's runs, one launch: uneven chunks on 3 and 4
#: ranks, a tensor with fewer elements than ranks (empty chunks)
SIGN_NUMELS = (1001, 37, 2, 64)
SIGN_STEPS = 3


def sign_inputs(world, step):
    """Every rank's new input at ``step`` of those runs: ``[rank][tensor]`` float32."""
    out = []
    for rank in range(world):
        gen = np.random.default_rng(1000 * step + rank)
        out.append([gen.standard_normal(n).astype(np.float32) for n in SIGN_NUMELS])
    return out


# -- region reduce's coded records (hvd_dgc/packing.py region_layout, region_block_bytes) --
def round_values(values, value_bits):
    """Values as one block sends them: ``(the values' bytes, each as it arrives, the
    block's scale or None)``: 8 bits as ``fp8_values`` with one scale for the block;
    16: fp16, clamped to its largest finite (what is beyond it arrives as that); 32: as
    they are. Not finite: sent as NaN (8 bits) or as it is."""
    values = f32(values)
    if value_bits == 8:
        codes, scales, arrived = fp8_values(values, np.zeros(values.size, np.int64), 1)
        return codes, arrived, scales[0]
    if value_bits == 16:
        with np.errstate(invalid="ignore"):
            half = np.where(np.isfinite(values), np.clip(values, -65504, 65504), values)
        half = half.astype(np.float16)
        return half.view(np.uint8), half.astype(np.float32), None
    return values.view(np.uint8), values, None


def region_block(positions, values, space, value_bits):
    """One owner's block: ``positions`` (sorted, in its region space of ``space``) and
    their ``values``, as ``[count int32][scale][positions coded][values]``. Returns
    ``(bytes, the values as they arrive)``; no bytes where the space is empty."""
    positions = np.asarray(positions, np.int64)
    if space == 0:
        return np.zeros(0, np.uint8), f32(values)
    count = np.array([positions.size], np.int32).view(np.uint8)
    if positions.size == 0:
        return count, f32(values)
    coded, arrived, scale = round_values(values, value_bits)
    parts = [count] + ([np.array([scale], np.float32).view(np.uint8)] if scale is not None
                       else []) + [encode_positions(positions, space), coded]
    return np.concatenate(parts), arrived


class CodedRegionReduce(NamedTuple):
    indices: np.ndarray   # the launch's joint indices of the update, sorted
    values: np.ndarray    # their sums over ranks, as they arrive (float32)
    returned: list        # per rank, (indices, values) its owner's residual takes
    lost: list            # per rank, (indices, values) its sends' rounding (where not 0),
    #                       back in its memory
    to_owners: list       # per rank, its block for each owner (round 1)
    kept: list            # per rank, its kept block (round 2)


def region_reduce_coded(selections, numels, ks, value_bits):
    """Region reduce of one launch (tensors of ``numels`` elements selecting ``ks``, one
    joint index space, tensor after tensor) on the coded wire, every rank at once.
    ``selections[i]``: rank i's (joint indices, values), distinct indices. Sender: each
    record to the owner of its index (index mod R_t), at position offset(j, t) + i // R_t
    of that owner's region space, sorted; rounding per block. Owner: sums what arrived in
    rank order (float32), keeps per tensor its ``quota`` largest |sum| (lower index on
    ties), rounds them as one block; what it did not keep, and the rounding of what it
    kept, go back into its residual."""
    from hvd_dgc.aggregation import quota
    from hvd_dgc.packing import region_layout
    world = len(selections)
    layout = region_layout(tuple(numels), tuple(ks), world)
    starts = np.cumsum(numels) - np.asarray(numels)
    r = np.asarray(layout.regions, np.int64)

    def place(joint):
        t = np.searchsorted(starts, joint, side="right") - 1
        local = joint - starts[t]
        owner = local % r[t]
        return t, owner, layout.offsets[owner, t] + local // r[t]

    def joint_of(owner, positions):
        t = np.searchsorted(layout.offsets[owner], positions, side="right") - 1
        return starts[t] + (positions - layout.offsets[owner, t]) * r[t] + owner

    to_owners, lost, arrived_at = [], [], [[] for _ in range(world)]
    for i, (idx, val) in enumerate(selections):
        idx, val = np.asarray(idx, np.int64), f32(val)
        _, owner, pos = place(idx)
        blocks, lost_i, lost_v = [], [], []
        for j in range(world):
            mine = np.flatnonzero(owner == j)
            mine = mine[np.argsort(pos[mine], kind="stable")]
            block, arrived = region_block(pos[mine], val[mine], int(layout.spaces[j]),
                                          value_bits)
            blocks.append(block)
            arrived_at[j].append((idx[mine], arrived))
            with np.errstate(invalid="ignore"):
                rest = np.where(np.isfinite(val[mine]), val[mine] - arrived, F32(0))
            lost_i.append(idx[mine])
            lost_v.append(rest.astype(np.float32))
        to_owners.append(blocks)
        li, lv = np.concatenate(lost_i), np.concatenate(lost_v)
        order = np.argsort(li, kind="stable")
        li, lv = li[order], lv[order]
        lost.append((li[lv != 0], lv[lv != 0]))
    kept_blocks, returned, out_i, out_v = [], [], [], []
    for j in range(world):
        cat_i = np.concatenate([a for a, _ in arrived_at[j]])
        cat_v = np.concatenate([b for _, b in arrived_at[j]])
        support, inverse = np.unique(cat_i, return_inverse=True)
        sums = np.zeros(support.size, np.float32)
        np.add.at(sums, inverse, cat_v)
        t = place(support)[0]
        keep = np.zeros(support.size, bool)
        for tensor in np.unique(t):
            at = np.flatnonzero(t == tensor)
            order = at[np.lexsort((support[at], -np.abs(sums[at])))]
            keep[order[:quota(ks[tensor], world)]] = True
        block, arrived = region_block(place(support[keep])[2], sums[keep],
                                      int(layout.spaces[j]), value_bits)
        kept_blocks.append(block)
        back = sums.copy()
        back[keep] = sums[keep] - arrived
        rest = ~keep | (back != 0)
        returned.append((support[rest], back[rest]))
        out_i.append(support[keep])
        out_v.append(arrived)
        assert (joint_of(j, place(support[keep])[2]) == support[keep]).all()
    indices, values = np.concatenate(out_i), np.concatenate(out_v)
    order = np.argsort(indices, kind="stable")
    return CodedRegionReduce(indices[order], values[order], returned, lost, to_owners,
                             kept_blocks)
