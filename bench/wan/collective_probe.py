"""One rank of bench/round_trips.py --probe: the time of single Horovod collectives,
no training, so the link's round trips per operation show (argv: probes to time).

    allreduce        one float
    allgather_fixed  10 records of 8 bytes, every step the same
    allgather_vary   10-12 records, a different count each step (as an unpadded CPU
                     selection sends)
    two_ops_fixed    a grouped allreduce of two small tensors and a grouped allgather
                     of three fixed ones, started together (a bucket's dense and sparse
                     parts)
"""

import json
import sys
import time

import torch
import horovod.torch as hvd


def probe(kind, i, rank):
    if kind == "allreduce":
        hvd.allreduce(torch.zeros(1), name="probe.allreduce")
    elif kind == "allgather_fixed":
        hvd.allgather(torch.zeros(10, 8, dtype=torch.uint8), name="probe.fixed")
    elif kind == "allgather_vary":
        hvd.allgather(torch.zeros(10 + (i + rank) % 3, 8, dtype=torch.uint8),
                      name="probe.vary")
    elif kind == "two_ops_fixed":
        dense = hvd.grouped_allreduce_async([torch.zeros(5), torch.zeros(7)],
                                            name="probe.dense")
        sparse = hvd.grouped_allgather_async(
            [torch.zeros(10, 8, dtype=torch.uint8) for _ in range(3)], name="probe.sparse")
        hvd.synchronize(dense)
        hvd.synchronize(sparse)
    else:
        raise ValueError(f"unknown probe {kind!r}")


def main():
    hvd.init()
    rank, out = hvd.rank(), {}
    for kind in sys.argv[1:]:
        for i in range(3):
            probe(kind, i, rank)
        start = time.perf_counter()
        for i in range(8):
            probe(kind, i, rank)
        out[kind] = (time.perf_counter() - start) / 8
    if rank == 0:
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
