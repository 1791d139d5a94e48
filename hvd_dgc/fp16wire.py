"""fp16 on the dense path (Horovod's ``Compression.fp16``, ``dense_compression=fp16``):
how much of a value may go on the wire, and where the rest goes. Framework-free,
used by the torch and TF sides alike.

fp16 holds magnitudes up to 65504. An accumulated value beyond that became inf on
the wire: every rank saw a non-finite average and skipped the step, so a finite
gradient was lost, and where momentum kept the value that large, every later step
too (issue 18). Horovod sums an fp16 allreduce in fp16, so the bound is on the sum:
each of N ranks sends at most ``fp16_bound(N, prescale)``, chosen so that N such
values, prescaled and added one by one with fp16's rounding, stay finite. What is
above stays in the residual, as fp16's rounding error does, and leaves in later
steps (error feedback): nothing is lost, an outlier arrives over several steps.
A NaN or an inf is not clipped: it is a non-finite gradient, and ``skip_nonfinite``
must see it.
"""

import numpy as np

__all__ = ["FP16_MAX", "fp16_bound", "fp16_payload", "clip_warning"]

FP16_MAX = 65504.0
_ROUNDING = 2.0 ** -11  # fp16's unit roundoff: each addition of the sum may add this much


def fp16_bound(world, prescale=1.0):
    """Largest magnitude one rank may put on an fp16 allreduce of ``world`` ranks whose
    values Horovod multiplies by ``prescale`` before summing: an fp16 number, so the
    clipped value casts exactly. Worst case, each of the N-1 additions rounds up."""
    limit = FP16_MAX / (world * prescale * (1.0 + _ROUNDING) ** (world - 1))
    bound = np.float16(min(limit, FP16_MAX))
    if float(bound) > limit:  # the cast rounded up: the fp16 number below it
        bound = np.nextafter(bound, np.float16(0))
    return float(bound)


def fp16_payload(v, world, prescale=1.0):
    """NumPy reference of one rank's dense fp16 send: ``(payload, residual, clipped)``.
    ``payload`` (float16) goes on the wire; ``residual`` (float32) = v - payload stays in
    the memory (exact: the subtraction of a nearby fp16 number), 0 where v is not finite
    (it left whole; the memory is not poisoned for the steps after); ``clipped`` counts
    the finite values beyond the bound."""
    v = np.asarray(v, np.float32)
    bound = np.float32(fp16_bound(world, prescale))
    finite = np.isfinite(v)
    payload = np.where(finite, np.clip(v, -bound, bound), v).astype(np.float16)
    residual = np.where(finite, v, 0) - np.where(finite, payload.astype(np.float32), 0)
    return payload, residual, int(np.count_nonzero(finite & (np.abs(v) > bound)))


def clip_warning(framework, step, count, bound):
    """The warning for values beyond fp16's range on the dense wire."""
    return (f"hvd_dgc ({framework}): step {step}: {count} accumulated gradient value(s) "
            f"beyond what fp16 can carry in a sum over all ranks (|x| > {bound:g}) were sent "
            f"clipped to it; the rest stays in the residual and leaves in later steps, so "
            f"nothing is lost, but values this large usually mean a too high learning rate "
            f"or loss scale. compression=hvd.Compression.none sends fp32 on the dense wire.")
