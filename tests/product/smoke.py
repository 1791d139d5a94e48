"""Collectives smoke test bodies: Horovod itself works, per framework and controller, and
so does each framework's seam (hvd_dgc/seam.py) over it."""


def torch_collectives():
    import torch
    import hvd_dgc.torch as hvd
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    avg = hvd.allreduce(torch.tensor([float(r + 1), 10.0 * (r + 1)]), op=hvd.Average, name="avg")
    gathered = hvd.allgather(torch.arange(r + 1, dtype=torch.float32) + 100 * r, name="ag")
    packed = hvd.allgather(torch.full((r + 2, 6), r, dtype=torch.uint8), name="ag_u8")
    from horovod.torch.mpi_ops import global_process_set
    from hvd_dgc.torch.seam import HorovodCollectives
    return {"rank": r, "size": n, "avg": avg.tolist(), "gathered": gathered.tolist(),
            "packed_shape": list(packed.shape), "packed_sum": int(packed.sum()),
            "seam": _seam(HorovodCollectives(global_process_set), hvd.cross_rank())}


def tf_collectives():
    import tensorflow as tf
    import hvd_dgc.tensorflow as hvd
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    avg = hvd.allreduce(tf.constant([float(r + 1), 10.0 * (r + 1)]), op=hvd.Average, name="avg")
    gathered = hvd.allgather(tf.range(r + 1, dtype=tf.float32) + 100.0 * r, name="ag")
    from horovod.tensorflow.mpi_ops import global_process_set
    from hvd_dgc.tensorflow.seam import HorovodCollectives
    return {"rank": r, "size": n, "avg": avg.numpy().tolist(),
            "gathered": gathered.numpy().tolist(),
            "seam": _seam(HorovodCollectives(global_process_set), hvd.cross_rank())}


def _seam(collectives, cross_rank):
    """hvd_dgc/seam.py's contract, the same on both frameworks' ``HorovodCollectives``:
    each collective on real Horovod, and the core's consistency check and link probe on
    top of it."""
    from hvd_dgc.consistency import check_consistent
    from hvd_dgc.linkprobe import probe_link
    from hvd_dgc.seam import host_peers
    r = collectives.rank
    out = {"size": collectives.size, "ranks": collectives.ranks,
           # rank 0 sends nothing, rank 1 three bytes
           "bytes": [b.decode() for b in collectives.allgather_bytes(b"abc" * r, "t.bytes")],
           "max": collectives.max([float(r), -float(r)], "t.max"),
           "async": collectives.wait(collectives.max_async([10.0 * r], "t.async")),
           "timed": [collectives.timed_allreduce(1024, "t.ar"),
                     collectives.timed_allgather(1024, "t.ag"),
                     collectives.timed_alltoall([0, 0], "t.a2a")],
           "peers": list(host_peers(collectives, cross_rank))}
    check_consistent(collectives, {"density": 0.001, "tensors": ["a", "b"]}, "same")
    try:
        check_consistent(collectives, {"density": 0.001 * (r + 1), "tensors": ["a"] + ["b"] * r},
                         "odd")
    except ValueError as e:
        out["refused"] = str(e)
    link = probe_link(collectives)
    out["link"] = [link.alpha, link.bandwidth]
    return out

