"""An outer loop for far, slow links: ``DistributedOptimizer(opt, outer=OuterLoop(...))``.

DiLoCo (Douillard et al., 2023, arXiv:2311.08105): every rank runs ``steps`` (H) inner
steps of its own optimizer (AdamW, SGD, anything) from the shared weights ``anchor``,
with no communication at all; then the ranks average the pseudo-gradient, the weights'
change ``delta = anchor - x`` since the last round, and an outer optimizer applies it
to the anchor (Nesterov momentum, lr 0.7 and momentum 0.9 in the paper), which every
rank then starts its next round from. H = 500 matched data-parallel perplexity with
500x less communication there.

The pseudo-gradient travels as DGC sends a gradient (SparseLoCo, 2025, sends it as
error-feedback top-k at 1-3%): ``density`` of its largest coordinates, what is not sent
kept in this rank's residual and sent in a later round, nothing lost; ``density=1.0``
sends it whole (an allreduce). With momentum 0, lr 1 and H = 1 the outer step is
synchronous training exactly (tests/torch/test_outer.py).

``overlap=True`` (Streaming DiLoCo, DiLoCoX): a round's exchange runs while the next
round's inner steps do, and its average is applied one round late, as delayed gradient
averaging applies a step's: at the end of round j the average of round j-1 moves the
shared weights, and each rank goes on from them plus its own change of round j (whose
average is not known yet)::

    anchor <- anchor - lr * step(average of round j-1)
    x      <- anchor - d_j            d_j: this rank's own change in round j

so every rank is back on the common trajectory but for its latest round; ``flush()``
waits for what is in flight and ends the round under way at once (every rank then
holds the same weights: before evaluating, checkpointing, or at the end).

The outer update, on the average ``a`` of what the ranks sent::

    b <- momentum * b + a                  (b: the outer momentum, every rank alike)
    anchor <- anchor - lr * (a + momentum * b)   Nesterov
    anchor <- anchor - lr * b                    heavy ball (nesterov=False)

Written once here (configuration and the update's arithmetic on anything that has
``*`` and ``+``); PyTorch's optimizer is hvd_dgc/torch/outer.py; the NumPy reference
is tests/reference.py ``outer_round``.
"""

import dataclasses
from typing import NamedTuple

from hvd_dgc.packing import plane_bytes
from hvd_dgc.say import rank0_once
from hvd_dgc.schedule import num_selected

__all__ = ["OuterLoop", "outer_step", "check_outer", "round_ks", "round_bytes",
           "outer_stats", "RecordLayout", "VALUE_BYTES", "VALUE_BITS"]

#: fp32 on the dense path.
VALUE_BYTES = 4
#: What a record's value may travel as: its fp32 bits, or a sign and ``bits - 1`` bits of
#: magnitude (SparseLoCo sends 2).
VALUE_BITS = (32, 8, 4, 2)


class OuterLoop(NamedTuple):
    """The outer loop's settings: ``steps`` inner steps per round (H), the outer
    optimizer's ``lr``, ``momentum`` and ``nesterov``; ``overlap``: each round's exchange
    behind the next round's inner steps, applied one round late; ``residual_decay``
    (beta, sent sparse only): the residual is multiplied by it each round before the
    round's change is added, ``v <- beta * v + d`` (SparseLoCo's error feedback: 1 keeps
    everything owed; below 1 what the inner steps make again is not owed twice);
    ``value_bits`` (sent sparse only): each record's value as its fp32 bits (32), or as
    a sign and ``value_bits - 1`` bits of magnitude (``RecordLayout``), the rounding
    kept in the residual."""

    steps: int = 32
    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True
    overlap: bool = False
    residual_decay: float = 1.0
    value_bits: int = 32

    def check(self):
        """Raises ValueError naming the bad setting and what works; returns self."""
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"OuterLoop(steps={self.steps!r}): the inner steps per round must "
                             f"be an int >= 1 (DiLoCo: 32-500; 1 exchanges every step)")
        for name in ("lr", "momentum"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"OuterLoop({name}={value!r}) must be a number")
        if not 0 < self.lr <= 2:
            raise ValueError(f"OuterLoop(lr={self.lr!r}): the outer learning rate scales the "
                             f"averaged change of the weights; it must be in (0, 2] (1 "
                             f"applies the average as it is; DiLoCo uses 0.7)")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"OuterLoop(momentum={self.momentum!r}) must be in [0, 1) "
                             f"(DiLoCo uses 0.9; 0: no outer momentum)")
        if (isinstance(self.residual_decay, bool)
                or not isinstance(self.residual_decay, (int, float))
                or not 0 < self.residual_decay <= 1):
            raise ValueError(f"OuterLoop(residual_decay={self.residual_decay!r}) must be a "
                             f"number in (0, 1] (1 keeps every unsent coordinate owed; "
                             f"SparseLoCo uses 0.95)")
        if isinstance(self.value_bits, bool) or self.value_bits not in VALUE_BITS:
            raise ValueError(f"OuterLoop(value_bits={self.value_bits!r}) must be one of "
                             f"{VALUE_BITS} (32: the values' fp32 bits; 2: a sign and one "
                             f"bit of magnitude, as SparseLoCo)")
        if not isinstance(self.nesterov, bool):
            raise ValueError(f"OuterLoop(nesterov={self.nesterov!r}) must be True or False")
        if not isinstance(self.overlap, bool):
            raise ValueError(f"OuterLoop(overlap={self.overlap!r}) must be True or False")
        if self.nesterov and self.momentum == 0:
            raise ValueError("OuterLoop(nesterov=True) needs momentum > 0; pass "
                             "nesterov=False for a plain outer SGD step")
        return self

    def words(self):
        kind = "Nesterov" if self.nesterov else ("momentum" if self.momentum else "SGD")
        return (f"outer loop (DiLoCo): {self.steps} inner step(s) per round, then the "
                f"weights' change averaged and applied by outer {kind} "
                f"(lr {self.lr:g}" + (f", momentum {self.momentum:g})" if self.momentum
                                      else ")")
                + (f"; the residual decayed by {self.residual_decay:g} a round"
                   if self.residual_decay != 1 else "")
                + (f"; values in {self.value_bits} bits" if self.value_bits < 32 else "")
                + ("; each exchange overlapped with the next round, applied one round "
                   "late (flush() before evaluating)" if self.overlap else ""))


def outer_step(config, average, momentum_buffer):
    """The outer update's step and the new momentum buffer, for ``anchor -= lr * step``:
    ``(step, buffer)``. ``momentum_buffer`` None: the first round (buffer = average)."""
    m = config.momentum
    if not m:
        return average, None
    buffer = average if momentum_buffer is None else momentum_buffer * m + average
    return (average + buffer * m if config.nesterov else buffer), buffer


def round_ks(numels, density, min_compress_size):
    """Coordinates each tensor sends a round: all of it (density 1.0, or a tensor below
    ``min_compress_size``), else the density's share (at least one)."""
    return [n if density >= 1 or n < min_compress_size else num_selected(n, density)
            for n in numels]


class RecordLayout(NamedTuple):
    """One rank's records of a round as the bytes of one allgather (every rank's the same
    size, so the gathered buffer is ``[world, nbytes]``): the ``count`` positions
    (int32), then for low-bit values each tensor's smallest and largest sent magnitude
    (``lo``, ``hi``: fp32), then the values: fp32 bits, or a code a record as
    ``value_bits`` bit planes (hvd_dgc/packing.py, the quantising compressors' layout).
    A code holds the sign (its top bit) and a level ``m`` in ``0 .. L - 1``
    (``L = 2 ** (value_bits - 1)``); the value
    that arrives is ``+-(lo + m * (hi - lo) / (L - 1))``, ``m`` the nearest level (half
    to even). With 2 bits a value arrives as its tensor's ``lo`` or ``hi``."""

    count: int        # records (sum of the tensors' k)
    tensors: int      # tensors (each its own lo and hi)
    value_bits: int

    @property
    def levels(self):
        return 1 << (self.value_bits - 1)

    @property
    def values_at(self):
        return 4 * self.count + (8 * self.tensors if self.value_bits < 32 else 0)

    @property
    def nbytes(self):
        return self.values_at + (4 * self.count if self.value_bits == 32
                                 else plane_bytes(self.count, self.value_bits))


def round_bytes(numels, ks, density, value_bits=32):
    """What one rank sends a round: the change whole (fp32), or its records."""
    if density >= 1:
        return sum(numels) * VALUE_BYTES
    return RecordLayout(sum(ks), len(ks), value_bits).nbytes


def outer_stats(outer, density, inner, rounds, bytes_sent, numels, in_flight, world_size,
                waited=None):
    """``compression_stats()`` of the outer loop (this rank), the same keys in PyTorch
    and TensorFlow and the same meaning as DGC's: ``dense_fp32_bytes`` is what Horovod
    would have sent (the fp32 gradient every inner step), ``compression_ratio`` it over
    ``bytes_sent``; ``round_fp32_bytes`` the change sent whole every round;
    ``waited_seconds`` how long this rank's training stood still at round ends waiting
    for an exchange (the wall time the link cost it; None where the wait happens inside
    a traced step, TensorFlow without overlap)."""
    numel = sum(numels)
    dense = inner * numel * VALUE_BYTES
    return {"mode": "outer", "inner_steps": inner, "rounds": rounds,
            "steps_per_round": outer.steps, "density": density, "current_density": density,
            "bytes_sent": bytes_sent, "dense_fp32_bytes": dense,
            "round_fp32_bytes": rounds * numel * VALUE_BYTES,
            "compression_ratio": dense / bytes_sent if bytes_sent else 1.0,
            "paths": {"dense" if density >= 1 else "sparse": rounds * len(numels)},
            "in_flight": int(in_flight), "world_size": world_size,
            "waited_seconds": waited}


def check_outer(outer, config, compression_is_default, op_is_average):
    """The wrapper's options with ``outer=``: returns the checked ``OuterLoop``, or raises
    naming the option that means nothing in an outer loop and what to do instead.
    ``config``: the ``DGCConfig`` of the call's hvd_dgc options."""
    if not isinstance(outer, OuterLoop):
        raise TypeError(f"outer must be a hvd_dgc.OuterLoop(steps=..., lr=..., momentum=...), "
                        f"got {outer!r}")
    outer.check()
    if config.lagging:
        raise ValueError(f"outer=OuterLoop(...) with {config.lagging}: the outer loop already "
                         f"exchanges once every {outer.steps} steps; use OuterLoop(steps=...) "
                         f"for fewer exchanges and drop {config.lagging}.")
    density = config.density
    if config.warmup or not (density is None or (
            isinstance(density, (int, float)) and not isinstance(density, bool)
            and 0 < density <= 1)):
        raise ValueError(f"outer=OuterLoop(...) takes density as a number in (0, 1] (the "
                         f"share of each tensor's change sent per round; 1.0, the default, "
                         f"sends it whole), without warmup; got density={density!r}, "
                         f"warmup={config.warmup!r}.")
    if outer.residual_decay != 1 and (density is None or density >= 1):
        raise ValueError(f"OuterLoop(residual_decay={outer.residual_decay!r}) decays what "
                         f"the sparse exchange still owes; with the change sent whole "
                         f"(density 1.0) nothing is owed: pass density < 1 (SparseLoCo: "
                         f"0.01-0.03) or drop residual_decay.")
    if outer.value_bits < 32 and (density is None or density >= 1):
        raise ValueError(f"OuterLoop(value_bits={outer.value_bits!r}) sends the records' "
                         f"values in fewer bits; with the change sent whole (density 1.0) "
                         f"there are no records: pass density < 1 or drop value_bits.")
    if not compression_is_default:
        raise ValueError("outer=OuterLoop(...) sends the weights' change as DGC's records "
                         "(density) or whole: pass no compression (or Compression.none / "
                         "Compression.dgc).")
    if not op_is_average:
        raise ValueError("outer=OuterLoop(...) averages the weights' change: op must be "
                         "Average.")
    unused = [f"{f.name}={getattr(config, f.name)!r}" for f in dataclasses.fields(config)
              if f.name not in _OUTER_READS and getattr(config, f.name) != f.default]
    if unused:  # DGC's per-step options: the outer loop has no per-step exchange
        rank0_once(f"hvd_dgc: outer=OuterLoop(...) uses density and min_compress_size "
                   f"only; {', '.join(unused)} {'does' if len(unused) == 1 else 'do'} nothing "
                   f"here: drop "
                   f"{'it' if len(unused) == 1 else 'them'}.", UserWarning,
                   key="hvd_dgc.outer_unused")
    if outer.overlap and outer.momentum > 0:  # (bench/results/zoo.md)
        rank0_once(f"hvd_dgc: OuterLoop(overlap=True, momentum={outer.momentum}) applies "
                   f"momentum to averages one round late: it lost 7.3% loss on a GPT-style "
                   f"LM and 4.4 points on a CNN (bench/results/zoo.md). Use OuterLoop() "
                   f"(no overlap), or overlap with momentum=0.0, lr=1.0.", UserWarning,
                   key="hvd_dgc.outer_overlap_momentum")
    return outer


#: The options the outer loop reads (or refuses above); the others are DGC's per step.
_OUTER_READS = frozenset({"density", "min_compress_size", "warmup", "delay", "period",
                          "verbose"})
