"""Keras callbacks: Horovod's, a broadcast that also works under Keras 3, and the
DGC warm-up/statistics callback."""

import tensorflow as tf
import horovod.tensorflow as _hvd
from horovod.tensorflow.keras.callbacks import *  # noqa: F401,F403


class BroadcastGlobalVariablesCallback(tf.keras.callbacks.Callback):
    """Broadcast the model's and optimizer's variables from ``root_rank`` before training.

    Horovod's version calls ``Variable.ref()``, which Keras 3 variables lack;
    this one assigns the broadcast values and works with Keras 2 and 3."""

    def __init__(self, root_rank=0, device=""):
        super().__init__()
        self.root_rank = root_rank
        self.done = False

    def _broadcast(self):
        variables = list(self.model.variables)
        opt = getattr(self.model, "optimizer", None)
        opt_vars = getattr(opt, "variables", None) if opt is not None else None
        if opt_vars is not None and not callable(opt_vars):  # DGC memory is not among them
            seen = {id(v) for v in variables}
            variables += [v for v in opt_vars if id(v) not in seen]
        for i, v in enumerate(variables):
            v.assign(_hvd.broadcast(tf.convert_to_tensor(v), self.root_rank,
                                    name=f"hvd_dgc.bcast.{i}"))
        self.done = True

    def on_train_begin(self, logs=None):
        if self.model.built and not self.done:
            self._broadcast()

    def on_train_batch_end(self, batch, logs=None):
        if not self.done:
            self._broadcast()


class DGCCallback(tf.keras.callbacks.Callback):
    """Drives an epoch-based sparsity warm-up, logs compression statistics and, with
    delayed averaging (``delay=D``), flushes the steps in flight before each
    evaluation (so every rank evaluates the same weights) and when ``fit`` ends.

    Args:
        verbose: print the statistics at the end of each epoch on rank 0.
    """

    def __init__(self, verbose=1):
        super().__init__()
        self.verbose = verbose
        self.history = []

    def on_test_begin(self, logs=None):
        self.model.optimizer.flush()

    def on_train_end(self, logs=None):
        self.model.optimizer.flush()

    def on_epoch_begin(self, epoch, logs=None):
        self.model.optimizer.set_epoch(epoch)

    def on_epoch_end(self, epoch, logs=None):
        stats = self.model.optimizer.compression_stats()
        self.history.append(stats)
        if logs is not None:
            logs["dgc_density"] = stats["density"]
        if self.verbose and _hvd.rank() == 0:
            print(f"[hvd_dgc] epoch {epoch}: density {stats['current_density']:.4g}, "
                  f"sent {stats['bytes_sent'] / 1e6:.3f} MB vs dense "
                  f"{stats['dense_fp32_bytes'] / 1e6:.3f} MB "
                  f"({stats['compression_ratio']:.1f}x), paths {stats['paths']}", flush=True)
