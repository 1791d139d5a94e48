"""``import hvd_dgc.tensorflow.keras as hvd``: Horovod's Keras API plus a DGC optimizer.

``hvd.DistributedOptimizer(opt, ...)`` keeps Horovod's signature and works with
legacy Keras 2 (tf_keras, ``TF_USE_LEGACY_KERAS=1``) and with Keras 3, which
Horovod 0.28.1 itself does not support (horovod issue #4290: Keras 3 calls
``apply_gradients``/``apply`` directly and its variables have no ``.ref()``).
hvd_dgc hooks the step where the gradients meet the optimizer (``apply`` in
Keras 3, ``apply_gradients`` in Keras 2) and exchanges them with Horovod's TF
collectives, so ``model.fit`` is distributed under both.

Keras 2's legacy optimizers (``tf_keras.optimizers.legacy.*``, OptimizerV2) are
wrapped the same way (their slots are created before the step, as they have no
``build``).

With SGD (legacy or not) the optimizer's momentum is taken over by DGC's momentum
correction (the rebuilt optimizer runs with momentum 0), as on the PyTorch side.
A variable with an IndexedSlices gradient (an Embedding) bypasses DGC, so the
memory keeps a velocity for it alone and hands the SGD ``u = m u + avg``: the
update SGD's own momentum makes of Horovod's averaged slices.

With Adam and AdamW (Keras 3, tf_keras, tf_keras' legacy Adam) exact Adam runs to
``freeze_variance`` steps, then its second moment is frozen and DGC takes its first
moment over (hvd_dgc/adam.py; the Keras side: hvd_dgc/tensorflow/adam.py).

``outer=hvd.OuterLoop(steps=H)`` gives an outer loop instead (DiLoCo, any optimizer):
the optimizer steps locally and every H-th step ends a round that averages the weights'
change (hvd_dgc/tensorflow/outer.py).

The optimizer is hvd_dgc/tensorflow/optimizer.py's, its mixins joined to the user's
optimizer class in one place as Horovod's own wrapper does.
"""

import importlib

from horovod.tensorflow.keras import *  # noqa: F401,F403  (the one-line switch)

from hvd_dgc.autodelay import AutoDelay  # noqa: F401 (delay=hvd.AutoDelay(...))
from hvd_dgc.costmodel import CostModel  # noqa: F401 (cost_model=hvd.CostModel(...))
from hvd_dgc.linkwatch import LinkWatch  # noqa: F401 (link_watch=hvd.LinkWatch(...))
from hvd_dgc.schedule import DensitySchedule  # noqa: F401 (density=hvd.DensitySchedule(...))
from hvd_dgc.outer import OuterLoop  # noqa: F401 (outer=hvd.OuterLoop(...))
from hvd_dgc.tensorflow.compression import Compression  # noqa: F401
from hvd_dgc.tensorflow.optimizer import DistributedOptimizer  # noqa: F401

# Horovod's star import bound `callbacks` to its own module; ours extends it.
callbacks = importlib.import_module("hvd_dgc.tensorflow.keras.callbacks")
elastic = importlib.import_module("hvd_dgc.tensorflow.keras.elastic")  # and its KerasState
