"""What differs between Keras 2 (tf_keras, new and legacy) and Keras 3 optimizers, for
the Keras DistributedOptimizer, its callbacks and the elastic state."""

import tensorflow as tf

__all__ = ["is_keras3", "is_legacy", "optimizer_variables", "create_optimizer_variables"]


def is_keras3(optimizer):
    """Not a tf_keras optimizer (a user's subclass of one included: Horovod's own
    tests define theirs in the test module)."""
    return not any(c.__module__.startswith("tf_keras") for c in type(optimizer).__mro__)


def is_legacy(optimizer):
    """A Keras 2 legacy optimizer (``tf_keras.optimizers.legacy.*``, OptimizerV2)."""
    return hasattr(optimizer, "_create_all_weights") and not hasattr(optimizer, "build")


def optimizer_variables(optimizer):
    """Keras 3: a property; tf_keras (new and legacy): a method."""
    if optimizer is None:
        return []
    found = getattr(optimizer, "variables", None)
    return list(found() if callable(found) else found or [])


def create_optimizer_variables(optimizer, variables):
    """Slots and hyper-parameters now, outside any trace or cond (no variable may be
    born in a branch), and so that every rank holds the same list."""
    with tf.init_scope():
        if is_legacy(optimizer):  # OptimizerV2 has no build()
            optimizer._create_all_weights(variables)
        elif not (getattr(optimizer, "built", False) or getattr(optimizer, "_built", False)):
            optimizer.build(variables)  # Keras 3: .built, tf_keras: ._built
