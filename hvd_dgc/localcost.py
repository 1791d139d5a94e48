"""DGC's own work on this device, for the cost model (``cost_model="measure"``); and a
payload compressor's (sign, QSGD, bf16: ``PayloadCost``).

A sparse path does work the dense path does not: it selects (DGC's sampled threshold,
then a scan: per element of the tensor, and per candidate kept) and packs, unpacks and
adds the records of every rank. On a fast link that work can cost more than the dense
allreduce it replaces (the warm-up's first stages select a quarter of every tensor:
bench/results/step_overhead.md). costmodel.CostModel charges it as

    n sigma + k rho_select + k N rho_record

and this module fits the three from timings of the framework's own selection and record
handling on a synthetic memory of ``CALIBRATION_NUMEL`` elements, at the final density
and at ``HIGH_DENSITY``: ``select(numel, k)`` and ``records(k)`` return the seconds this
rank took (the faster of a few calls); ``agree`` takes the elementwise maximum over the
ranks, so every rank charges the same and plans alike (the slowest rank's work sets the
step). Written once; each framework passes its functions (hvd_dgc/torch/link.py).
"""

from typing import NamedTuple

__all__ = ["LocalCost", "PayloadCost", "calibrate", "calibrate_payload", "CALIBRATION_NUMEL",
           "HIGH_DENSITY"]

#: Elements of the synthetic memory timed (4 MiB of float32: past the caches, as a model's).
CALIBRATION_NUMEL = 1 << 20

#: The dense-ish density the per-record costs are fitted at (the warm-up's first stage).
HIGH_DENSITY = 0.25


class LocalCost(NamedTuple):
    """Seconds per element selected over, per record selected, per record received."""

    select_element_seconds: float
    select_record_seconds: float
    record_seconds: float

    def words(self):
        return (f"DGC's local work measured: {self.select_element_seconds * 1e9:.2f} ns per "
                f"element, {(self.select_record_seconds + self.record_seconds) * 1e9:.1f} ns "
                f"per record")


#: the name of the collective that agrees the timings
AGREE_NAME = "hvd_dgc.calibrate.agree"


def calibrate(select, records, collectives, low_density=0.001, numel=CALIBRATION_NUMEL):
    """``LocalCost`` from the framework's timed ``select(numel, k)`` and ``records(k)``,
    agreed over ``collectives`` (hvd_dgc/seam.py): the slowest rank's."""
    # a final density at or past the high point (density=1.0: dense averaging, the
    # warm-up's first stages) is fitted below it: two distinct points, neither past numel
    low = max(1, int(numel * min(low_density, HIGH_DENSITY / 2)))
    high = max(low + 1, int(numel * HIGH_DENSITY))
    t_low, t_high, t_records = collectives.max(
        [select(numel, low), select(numel, high), records(high)], AGREE_NAME)
    per_selected = max(t_high - t_low, 0.0) / (high - low)
    per_element = max(t_low - per_selected * low, 0.0) / numel
    return LocalCost(per_element, per_selected, max(t_records, 0.0) / high)


class PayloadCost(NamedTuple):
    """A payload compressor's own work (sign, QSGD, bf16), beyond the dense path's:
    seconds per element to encode this rank's payload, and per element to decode each
    rank's (every rank decodes all N: costmodel.CostModel.choose_exchange)."""

    encode_element_seconds: float
    decode_element_seconds: float

    def words(self):
        return (f"the compressor's local work measured: "
                f"{self.encode_element_seconds * 1e9:.2f} ns per element to encode, "
                f"{self.decode_element_seconds * 1e9:.2f} ns to decode each rank's")


def calibrate_payload(encode, decode, collectives, numel=CALIBRATION_NUMEL):
    """``PayloadCost`` from the framework's timed ``encode(numel)`` and ``decode(numel)``
    (seconds this rank took for one payload of ``numel`` elements, the faster of a few
    calls), agreed as ``calibrate``'s are: the slowest rank's."""
    t_encode, t_decode = collectives.max([encode(numel), decode(numel)], AGREE_NAME)
    return PayloadCost(max(t_encode, 0.0) / numel, max(t_decode, 0.0) / numel)
