"""Collectives smoke test bodies: Horovod itself works, per framework and controller."""


def torch_collectives():
    import torch
    import hvd_dgc.torch as hvd
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    avg = hvd.allreduce(torch.tensor([float(r + 1), 10.0 * (r + 1)]), op=hvd.Average, name="avg")
    gathered = hvd.allgather(torch.arange(r + 1, dtype=torch.float32) + 100 * r, name="ag")
    packed = hvd.allgather(torch.full((r + 2, 6), r, dtype=torch.uint8), name="ag_u8")
    return {"rank": r, "size": n, "avg": avg.tolist(), "gathered": gathered.tolist(),
            "packed_shape": list(packed.shape), "packed_sum": int(packed.sum())}


def tf_collectives():
    import tensorflow as tf
    import hvd_dgc.tensorflow as hvd
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    avg = hvd.allreduce(tf.constant([float(r + 1), 10.0 * (r + 1)]), op=hvd.Average, name="avg")
    gathered = hvd.allgather(tf.range(r + 1, dtype=tf.float32) + 100.0 * r, name="ag")
    return {"rank": r, "size": n, "avg": avg.numpy().tolist(),
            "gathered": gathered.numpy().tolist()}
