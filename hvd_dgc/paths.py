"""The ways one tensor can travel in one step: hvd_dgc's one path vocabulary.

The cost model chooses among them (hvd_dgc/costmodel.py), the planner assigns them
(hvd_dgc/plan.py), each framework has one class per kind (hvd_dgc/torch/paths.py,
hvd_dgc/tensorflow/paths.py), and the statistics count them under their values,
which are what ``compression_stats()["paths"]`` has always shown.
"""

from enum import Enum

__all__ = ["PathKind", "AGGREGATIONS", "AGGREGATION_OPTIONS", "SUMS", "ORDER",
           "compressor_kind"]


class PathKind(str, Enum):
    """How a tensor travels this step. A ``str`` (its value), so it keys the statistics
    as the plain name does; hashing and formatting are the string's on every Python."""

    #: ring allreduce of the whole velocity (small tensors, dense-ish densities)
    DENSE = "dense"
    #: every rank's k records ``[index | value]`` to every rank (DGC's sparse allgather;
    #: "sparse" in the statistics since the first release)
    ALLGATHER = "sparse"
    #: region reduce (after Ok-Topk): records to the owners of index regions, the owners'
    #: largest sums to everyone; bytes per rank flat in the number of ranks
    REGION = "region"
    #: several hosts of several ranks: summed densely inside each host, records across
    HIERARCHICAL = "hierarchical"
    #: a compressor that runs its own collectives (PowerSGD, sign, QSGD, bf16, TernGrad)
    EXCHANGE = "exchange"
    #: a sparse gradient (``nn.Embedding(sparse=True)``, ``tf.IndexedSlices``) as Horovod
    #: sends it: rows and indices allgathered, no DGC
    SPARSE_GRAD = "sparse_grad"
    #: a step between exchanges (``period > 1``): the memory accumulates, nothing leaves
    LOCAL = "local"

    __hash__ = str.__hash__

    def __str__(self):
        return self.value

    def __format__(self, spec):
        return format(self.value, spec)

    @property
    def sums_records(self):
        """Whether this path sums sparse records (and selects from the memory)."""
        return self in (PathKind.ALLGATHER, PathKind.REGION, PathKind.HIERARCHICAL)


#: what the cost model chooses among, in its order of preference on equal cost
AGGREGATIONS = (PathKind.ALLGATHER, PathKind.REGION, PathKind.HIERARCHICAL, PathKind.DENSE)

#: the optimizers' ``aggregation=`` option -> the paths the cost model may choose among
AGGREGATION_OPTIONS = {
    "auto": (PathKind.DENSE, PathKind.ALLGATHER, PathKind.REGION, PathKind.HIERARCHICAL),
    "allgather": (PathKind.ALLGATHER,),
    "region": (PathKind.REGION,),
    "hierarchical": (PathKind.HIERARCHICAL,),
    "dense": (PathKind.DENSE,),
    "flat": (PathKind.DENSE, PathKind.ALLGATHER, PathKind.REGION),
}

#: how sparse tensors are summed, in words (the rank-0 line)
SUMS = {PathKind.ALLGATHER: "allgather", PathKind.REGION: "region reduce",
        PathKind.HIERARCHICAL: "hierarchical: summed inside each host, records across hosts"}

#: the order a launch starts its paths in: the same on every rank, so every rank joins
#: the same collectives in the same order
ORDER = (PathKind.SPARSE_GRAD, PathKind.EXCHANGE, PathKind.ALLGATHER, PathKind.REGION,
         PathKind.HIERARCHICAL, PathKind.DENSE)


def compressor_kind(compression):
    """What a compressor does with a large tensor: ``"sparse"`` (selects records from
    the memory: DGC, top-k, random-k), ``"exchange"`` (its own collectives) or
    ``"dense"`` (Horovod's none/fp16 after the switch: dense averaging)."""
    if getattr(compression, "sparse", False):
        return "sparse"
    if getattr(compression, "exchanges", False):
        return "exchange"
    return "dense"
