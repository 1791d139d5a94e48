"""hvd_dgc: Deep Gradient Compression and Delayed Gradient Averaging for Horovod.

Framework-free parts live here (density schedule, cost model, statistics);
``hvd_dgc.torch`` and ``hvd_dgc.tensorflow`` are drop-ins for Horovod's modules.
"""

__version__ = "0.1.0"

from hvd_dgc.autodelay import AutoDelay  # noqa: E402,F401
from hvd_dgc.costmodel import CostModel  # noqa: E402,F401
from hvd_dgc.linkwatch import LinkWatch  # noqa: E402,F401
from hvd_dgc.outer import OuterLoop  # noqa: E402,F401
from hvd_dgc.schedule import DensitySchedule  # noqa: E402,F401
from hvd_dgc.stats import CompressionStats  # noqa: E402,F401
