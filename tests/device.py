"""Where the PyTorch workers put models and batches.

``HVD_DGC_TEST_DEVICE=cuda`` runs the same scenarios with CUDA tensors (Horovod built
with NCCL: tools/build_horovod_gpu.sh); each rank takes GPU ``local_rank % count``.
NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected"), so
when ranks outnumber GPUs each rank poses as a host of its own (``NCCL_HOSTID``) and
NCCL carries their traffic over sockets on loopback: slower, but the same collectives.
"""

import os

import torch

ENV = "HVD_DGC_TEST_DEVICE"


def kind():
    return os.environ.get(ENV, "cpu")


def device():
    if kind() == "cpu":
        return torch.device("cpu")
    import horovod.torch as hvd
    return torch.device(kind(), hvd.local_rank() % torch.cuda.device_count())


def prepare_process():
    """Before Horovod's first NCCL call: let ranks share a GPU."""
    if kind() != "cuda":
        return
    local_size = int(os.environ.get("HOROVOD_LOCAL_SIZE", "1"))
    if local_size > torch.cuda.device_count():
        rank = os.environ.get("HOROVOD_RANK", "0")
        os.environ.setdefault("NCCL_HOSTID", f"hvd-dgc-test-rank{rank}")
        os.environ.setdefault("NCCL_P2P_DISABLE", "1")
        os.environ.setdefault("NCCL_SHM_DISABLE", "1")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_IB_DISABLE", "1")


def sparse_momentum_deterministic(steps=8):
    """Whether torch's own SGD momentum on sparse gradients gives the same weights twice
    from the same coalesced gradients on this device. On an H200 it did not (4.8e-7 apart
    from the second step; equal without momentum or with deterministic algorithms: most
    likely the sparse momentum buffer's rows added with atomics). Where it does not, two
    runs (or two ranks) of the user's optimizer round differently from the same averaged
    gradients, whatever delivered them."""
    def run():
        w = torch.nn.Parameter(torch.linspace(-1, 1, 100 * 32, device=device()).view(100, 32))
        opt = torch.optim.SGD([w], lr=0.1, momentum=0.9)
        gen = torch.Generator().manual_seed(0)
        for _ in range(steps):
            g = torch.sparse_coo_tensor(torch.randint(0, 100, (1, 64), generator=gen),
                                        torch.randn(64, 32, generator=gen), (100, 32))
            w.grad = g.coalesce().to(device())
            opt.step()
        return w.detach()
    return bool(torch.equal(run(), run()))
