"""Predicted bytes and alpha-beta time per worker per step of dense, sparse allgather,
region reduce and the cost model's choice, for a list of tensor shapes (``simulate``).

Framework-free: k per tensor as the optimizer computes it
(hvd_dgc.schedule.num_selected), tensors under min_compress_size dense in every method
(as in the optimizer), and the formulas of hvd_dgc/aggregation.py (bytes, balanced
expectation) and hvd_dgc/costmodel.py (alpha-beta time). The tests check the formulas
with it (tests/core/test_aggregation.py); bench/sparse_aggregation_sim.py tabulates and plots
it for ResNet-50, bench/sparse_aggregation.py sets it beside measured bytes.
"""

from harness.shapes import numel
from hvd_dgc.aggregation import bytes_per_worker
from hvd_dgc.costmodel import CostModel
from hvd_dgc.paths import PathKind

DENSE, REGION, SPARSE = PathKind.DENSE, PathKind.REGION, PathKind.ALLGATHER
from hvd_dgc.schedule import num_selected

METHODS = ("dense", "allgather", "region")
_COST_NAME = {"dense": DENSE, "allgather": SPARSE, "region": REGION}
_BYTES_NAME = {DENSE: "dense", SPARSE: "allgather", REGION: "region"}
DEFAULT_WORLDS = tuple(2 ** p for p in range(1, 11))  # 2, 4, ..., 1024


def _seconds(cm, method, n, k, world, value_bytes, index_bytes, dense_value_bytes):
    if method == DENSE:
        return cm.dense_seconds(n, world, dense_value_bytes)
    if method == SPARSE:
        return cm.sparse_seconds(k, world, value_bytes, index_bytes)
    return cm.region_seconds(k, world, value_bytes, index_bytes)


def _buffers(sizes, density, min_compress_size, fused):
    """(n, k, dense_only) per collective: one per tensor, or with ``fused`` one
    dense buffer of the small tensors and one sparse buffer of the rest."""
    per_tensor = [(n, num_selected(n, density), n < min_compress_size) for n in sizes]
    if not fused:
        return per_tensor
    out = []
    for dense_only in (True, False):
        group = [(n, k) for n, k, d in per_tensor if d == dense_only]
        if group:
            out.append((sum(n for n, _ in group), sum(k for _, k in group), dense_only))
    return out


def simulate(shapes, density, worlds=DEFAULT_WORLDS, value_bytes=4, index_bytes=4,
             dense_value_bytes=4, min_compress_size=1024, cost_model=None, fused=False):
    """One row (dict) per world size N: bytes received per worker per step and
    alpha-beta seconds, for every method and for the cost model's choice.

    ``shapes``: tensor shapes, or (name, shape) pairs (resnet50_shapes()). Tensors
    under ``min_compress_size`` are dense in every method. ``fused=False``: one
    collective per tensor (each with its own k, quota and latency); ``fused=True``:
    the sparse tensors as one buffer (k = the sum of their k, one quota) and the
    small ones as one dense buffer, as Ok-Topk treats the whole model.
    Keys: mode, world, k (records one rank selects per step), collectives,
    {dense,allgather,region,auto}_bytes, {...}_seconds, auto_counts ({method: buffers}).
    """
    cm = cost_model or CostModel()
    sizes = [numel(s[1] if len(s) == 2 and isinstance(s[0], str) else s) for s in shapes]
    buffers = _buffers(sizes, density, min_compress_size, fused)
    rows = []
    for world in worlds:
        row = {"mode": "fused" if fused else "per-tensor", "world": world,
               "k": sum(k for _, k, d in buffers if not d), "collectives": len(buffers),
               "auto_counts": {m: 0 for m in METHODS}}
        for m in METHODS + ("auto",):
            row[f"{m}_bytes"] = 0.0
            row[f"{m}_seconds"] = 0.0
        for n, k, dense_only in buffers:
            choice = DENSE if dense_only else cm.choose_aggregation(
                n, k, world, dense_value_bytes, value_bytes, index_bytes)
            row["auto_counts"][_BYTES_NAME[choice]] += 1
            for m in METHODS + ("auto",):
                name = DENSE if dense_only else (choice if m == "auto" else _COST_NAME[m])
                row[f"{m}_bytes"] += bytes_per_worker(_BYTES_NAME[name], n, k, world,
                                                      value_bytes, index_bytes,
                                                      dense_value_bytes)
                row[f"{m}_seconds"] += _seconds(cm, name, n, k, world, value_bytes,
                                                index_bytes, dense_value_bytes)
        rows.append(row)
    return rows
