"""Drop-in for ``horovod.tensorflow``: ``import hvd_dgc.tensorflow as hvd``.

Re-exports everything ``horovod.tensorflow`` offers. hvd_dgc's TensorFlow
compressors and DistributedGradientTape are not written yet (issue 5): until
then this module is exactly Horovod's.
"""

from horovod.tensorflow import *  # noqa: F401,F403  (the drop-in contract)
from horovod.tensorflow import Average, Sum  # noqa: F401
