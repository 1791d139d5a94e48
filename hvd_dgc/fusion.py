"""Buckets: which tensors of a step leave together in one Horovod launch.

Horovod's tensor fusion at hvd_dgc's level (the planner's ``buckets``): consecutive
tensors in backward order, cut where their bytes on the wire would pass the fusion
threshold, and closed by the member whose transfer brings the bucket's past
``BUCKET_LATENCIES`` message latencies.
"""

import os

__all__ = ["BUCKET_LATENCIES", "HOROVOD_FUSION_DEFAULT", "cut", "fusion_threshold"]

#: A bucket closes with the member that brings its transfer past this many message
#: latencies (the cost model's alpha). A bucket saves the Horovod operations of its
#: members but one, about two round trips each (bench/results/round_trips.md: 5 for two
#: operations, 3 for one), and holds its early members back until its last is ready: so
#: what it holds back is short, and a long transfer (a large layer's weight, after its
#: bias) ends its bucket and leaves as soon as it is ready, overlapping the backward pass
#: as Horovod's do. Measured (bench/never_slower.py's wide_mlp, 2 ranks, 1 Gbit/s
#: emulated, density 0.25 with every large tensor dense): in buckets cut at 64 MiB only,
#: 39.0 and 40.8 img/s; without buckets 44.8 and 45.0; stock 44.8 and 45.8.
BUCKET_LATENCIES = 4
#: Horovod's HOROVOD_FUSION_THRESHOLD default
HOROVOD_FUSION_DEFAULT = 64 * 1024 * 1024


def fusion_threshold(value):
    """``fusion_threshold`` in bytes: the option (checked by DGCConfig), else Horovod's
    environment variable (``horovodrun --fusion-threshold-mb``), else Horovod's
    default."""
    if value is not None:
        return value
    raw = os.environ.get("HOROVOD_FUSION_THRESHOLD")
    if raw is None:
        return HOROVOD_FUSION_DEFAULT
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"HOROVOD_FUSION_THRESHOLD must be a number of bytes >= 0, got "
                         f"{raw!r}")
    return value


def cut(transfers, threshold, budget):
    """The launches, as tuples of keys, of ``transfers`` (``(key, bytes it adds to a
    launch, its transfer's seconds)`` in launch order): a launch is cut before the member
    that would bring its bytes past ``threshold``, and closed by the member that brings
    its seconds past ``budget`` (a long transfer: nothing after it holds it back)."""
    launches, members, size, seconds_in = [], [], 0, 0.0
    for key, wire, seconds in transfers:
        if members and size + wire > threshold:
            launches.append(tuple(members))
            members, size, seconds_in = [], 0, 0.0
        members.append(key)
        size += wire
        seconds_in += seconds
        if seconds_in > budget:
            launches.append(tuple(members))
            members, size, seconds_in = [], 0, 0.0
    if members:
        launches.append(tuple(members))
    return launches
