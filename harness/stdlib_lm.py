"""A real text corpus on every machine, and a small model to train on it: the Python
standard library's sources (of the interpreter that runs this; read at run time,
nothing downloaded or committed) and a byte-level transformer LM.

bench/adam_lm.py trains it for thousands of steps; tests/torch/test_adam_lm.py a few hundred.
"""

import glob
import math
import os
import sysconfig


def corpus(limit=6_000_000):
    """The standard library's .py files as bytes: training files and validation files
    (every 10th, by sorted path), each capped so a run reads a few MB. Returns
    ``(train, valid, root)``."""
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True))
    files = [f for f in files if "site-packages" not in f and "/test" not in f]
    train, valid, size = [], [], 0
    for i, path in enumerate(files):
        with open(path, "rb") as f:
            data = f.read()
        (valid if i % 10 == 0 else train).append(data)
        size += len(data)
        if size > limit:
            break
    return b"\n".join(train), b"\n".join(valid), root


def byte_lm(context=128, width=128, layers=2, heads=4):
    """A causal transformer over bytes (pre-norm, no dropout): embedding, learned
    positions, ``layers`` encoder layers, a 256-way head."""
    import torch
    import torch.nn as nn

    class ByteLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(256, width)
            self.pos = nn.Parameter(torch.randn(context, width) * 0.02)
            layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0,
                                               batch_first=True, norm_first=True)
            self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.head = nn.Linear(width, 256)
            self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(
                context), persistent=False)

        def forward(self, x):
            h = self.embed(x) + self.pos[:x.shape[1]]
            return self.head(self.body(h, mask=self.mask, is_causal=True))

    return ByteLM()


def keras_byte_lm(keras, context=128, width=128, layers=2, heads=4):
    """``byte_lm`` in Keras (2 or 3, the module given): the same layers and sizes
    (478,720 parameters at the defaults), for the TensorFlow side of the benchmark."""
    import tensorflow as tf

    class AddPositions(keras.layers.Layer):  # learned positions, as byte_lm's ``pos``
        def build(self, shape):
            self.pos = self.add_weight(
                name="pos", shape=(context, width),
                initializer=keras.initializers.RandomNormal(stddev=0.02))

        def call(self, h):
            return h + self.pos[:tf.shape(h)[1]]

    tokens = keras.Input((context,), dtype="int32")
    h = AddPositions()(keras.layers.Embedding(256, width)(tokens))
    for _ in range(layers):  # pre-norm encoder layers, causal, no dropout
        a = keras.layers.LayerNormalization(epsilon=1e-5)(h)
        a = keras.layers.MultiHeadAttention(heads, width // heads)(a, a, use_causal_mask=True)
        h = keras.layers.Add()([h, a])
        f = keras.layers.LayerNormalization(epsilon=1e-5)(h)
        f = keras.layers.Dense(width)(keras.layers.Dense(4 * width, activation="relu")(f))
        h = keras.layers.Add()([h, f])
    return keras.Model(tokens, keras.layers.Dense(256)(h))


class Batches:
    """Windows of ``context + 1`` bytes: a rank's training batches from its own
    generator (seeded by seed and rank), and one fixed validation set for everyone;
    torch tensors, or NumPy arrays (``as_numpy``: the TensorFlow side)."""

    def __init__(self, context, seed, rank, valid_windows=256, limit=6_000_000,
                 as_numpy=False):
        import numpy as np
        self.as_numpy = as_numpy
        train, valid, self.root = corpus(limit)
        self.train = np.frombuffer(train, dtype=np.uint8)
        self.valid = np.frombuffer(valid, dtype=np.uint8)
        self.context = context
        self.gen = np.random.default_rng(seed * 1000 + rank)
        self.valid_starts = np.random.default_rng(12345).integers(
            0, len(self.valid) - context - 1, size=valid_windows)

    def _take(self, data, starts):
        import numpy as np
        x = np.stack([data[s:s + self.context + 1] for s in starts]).astype(np.int64)
        if self.as_numpy:
            x = x.astype(np.int32)
        else:
            import torch
            x = torch.from_numpy(x)
        return x[:, :-1], x[:, 1:]

    def next(self, batch):
        return self._take(self.train, self.gen.integers(
            0, len(self.train) - self.context - 1, size=batch))

    def validation(self):
        return self._take(self.valid, self.valid_starts)


def lr_factor(step, steps):
    """bench/adam_lm.py ``--lr-schedule cosine``'s factor on the peak rate at ``step`` (0-based): linear
    warm-up over ``steps // 20`` steps, then a cosine from 1 to 0.1 at the last step."""
    warmup = max(1, steps // 20)
    if step < warmup:
        return (step + 1) / warmup
    done = min(1.0, (step - warmup) / max(1, steps - 1 - warmup))
    return 0.1 + 0.45 * (1.0 + math.cos(math.pi * done))


def loss_of(model, x, y):
    """Cross-entropy in nats per byte."""
    import torch.nn as nn
    return nn.functional.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))
