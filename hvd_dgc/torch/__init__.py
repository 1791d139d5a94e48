"""Drop-in for ``horovod.torch``: ``import hvd_dgc.torch as hvd``.

Everything ``horovod.torch`` offers is re-exported unchanged (init, rank,
allreduce, broadcast_parameters, broadcast_optimizer_state, ...), except
``DistributedOptimizer`` and ``Compression``, which are hvd_dgc's: the
optimizer compresses with DGC by default, and ``Compression`` holds
Horovod's ``none``/``fp16`` next to ``dgc``, ``topk``, ``randomk``,
``powersgd``, ``sign``, ``terngrad``, ``qsgd`` and ``bf16``.
"""

import importlib

from horovod.torch import *  # noqa: F401,F403  (the drop-in contract)
from horovod.torch import Average, Sum, Adasum  # noqa: F401  (explicit for readers)

from hvd_dgc.autodelay import AutoDelay  # noqa: F401
from hvd_dgc.linkwatch import LinkWatch  # noqa: F401 (link_watch=hvd.LinkWatch(...))
from hvd_dgc.costmodel import CostModel  # noqa: F401
from hvd_dgc.outer import OuterLoop  # noqa: F401
from hvd_dgc.schedule import DensitySchedule  # noqa: F401
from hvd_dgc.torch.compression import (  # noqa: F401
    BF16Compressor, Compression, DGCCompressor, PowerSGDCompressor, QSGDCompressor,
    RandomKCompressor, SignCompressor, SparseCompressor, TernGradCompressor, TopKCompressor)
from hvd_dgc.torch.optimizer import DistributedOptimizer  # noqa: F401
# Horovod's star import bound `elastic` to its own module; ours (Horovod's names, with
# TorchState keeping hvd_dgc's step and epoch in sync) takes its place, as in
# hvd_dgc.tensorflow
elastic = importlib.import_module("hvd_dgc.torch.elastic")
elastic.register()
