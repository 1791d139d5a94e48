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
