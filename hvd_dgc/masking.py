"""When momentum factor masking helps, shared by the PyTorch and TensorFlow sides.

Masking (DGC, Lin et al. 2018, Sec. 3.2) zeroes the momentum ``u`` of the
coordinates a worker just sent, so a stale velocity does not keep pushing them.
It also throws away their momentum tail: about ``m / (1 - m)`` steps' worth of
update (9 at m = 0.9) that dense momentum SGD would still apply. A coordinate
is sent about once every ``1 / density`` steps, so masking drops a fraction of
about ``density * m / (1 - m)`` of what it delivers: ~1% at the paper's 0.1%,
but more than all of it at the warm-up's 25% (sent every ~4 steps).

Measured (digits MLP, 2 ranks, SGD m = 0.9, 88 steps; dense Horovod 93.6%):
density 25% masked 70.8% / unmasked 93.3%; 1.56%: 90.6% / 93.3%; 0.4%:
86.9% / 87.8%. So ``momentum_masking="auto"`` (the default) masks only where
the tail lost is at most ``TAIL_LIMIT`` of a send: densities up to
``TAIL_LIMIT * (1 - m) / m`` (1.1% at m = 0.9): the paper's masking at its final
densities, none in the early warm-up stages. Where it masks it costs little: AdamW
taken over at 0.1% (bench/adam_lm.py, byte LM, 2 ranks, 3,000 steps) 1.3283 masked,
1.3267 unmasked; at 25% it is ruinous there too (500 steps: 2.2754 against 1.8121).
"""

import math

from hvd_dgc.say import rank0_once

__all__ = ["TAIL_LIMIT", "check_masking", "masking_density_limit"]

TAIL_LIMIT = 0.1


def check_masking(setting):
    if not (isinstance(setting, bool) or setting == "auto"):
        raise ValueError(f"momentum_masking must be True (always, as the paper), False (never) "
                         f"or 'auto' (where it helps: hvd_dgc/masking.py), got {setting!r}")
    return setting


def masking_density_limit(setting, momentum):
    """Sent coordinates lose their momentum at densities ``<=`` this (``inf``: always,
    ``-1``: never)."""
    if not momentum or setting is False:
        if setting is True:  # asked for, with no momentum to mask
            rank0_once("hvd_dgc: momentum_masking=True does nothing here: the optimizer has "
                       "no momentum (momentum=0), so nothing stale is left to mask; drop it.",
                       UserWarning, key="hvd_dgc.masking_unused")
        return -1.0
    if setting is True or momentum >= 1.0:
        return math.inf
    return TAIL_LIMIT * (1.0 - momentum) / momentum
