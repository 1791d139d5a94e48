"""TensorFlow side, single process: tests/test_reference.py's vectors give the same numbers
as the PyTorch side; packing, sampled selection and the in-graph density schedule."""

import math

import numpy as np
import pytest
import tensorflow as tf

from hvd_dgc import CostModel, DensitySchedule
from hvd_dgc.costmodel import SPARSE
from hvd_dgc.tensorflow.compression import Compression, SparseCompressor
from hvd_dgc.tensorflow.exchange import GradientExchange
from hvd_dgc.tensorflow.memory import DGCMemory

G = [0.5, -2.0, 0.1, 1.0]


def trace(masking, nesterov, steps=3):
    mem, sent = DGCMemory([4], momentum=0.9, nesterov=nesterov, momentum_masking=masking), []
    for _ in range(steps):
        v = mem.accumulate(0, tf.constant(G))
        idx = Compression.topk.select(v, 1, None)
        sent.append((int(idx[0]), round(float(tf.gather(v, idx)[0]), 5)))
        mem.sent(0, idx)
    return sent, mem


def test_memory_traces_match_the_reference_vectors():
    sent, mem = trace(masking=True, nesterov=False)
    assert sent == [(1, -2.0), (3, 2.9), (1, -5.8)]
    np.testing.assert_allclose(mem.u[0].numpy(), [1.355, 0, 0.271, 1.0], rtol=1e-6)
    np.testing.assert_allclose(mem.v[0].numpy(), [2.805, 0, 0.561, 1.0], rtol=1e-6)
    assert trace(masking=False, nesterov=False)[0] == [(1, -2.0), (1, -3.8), (3, 5.61)]
    assert trace(masking=True, nesterov=True)[0] == [(1, -3.8), (3, 4.61), (1, -9.22)]


def test_decompress_average_of_two_workers():
    a = SparseCompressor.pack(tf.constant([1.5, -2.0]), tf.constant([0, 3]))
    b = SparseCompressor.pack(tf.constant([0.5, 4.0]), tf.constant([3, 1]))
    assert a.dtype == tf.int32 and a.shape == (2, 2)  # 8 bytes per record
    total = SparseCompressor.scatter_sum(tf.concat([a, b], 0), 5).numpy() / 2
    np.testing.assert_array_equal(total, [0.75, 2.0, 0.0, -0.75, 0.0])


@pytest.mark.parametrize("n,density", [(100_000, 0.001), (50_000, 0.01), (3000, 0.1)])
def test_sampled_threshold_within_window(n, density):
    k = math.ceil(n * density)
    flat = tf.constant(np.random.RandomState(n).randn(n).astype(np.float32))
    idx = Compression.dgc.select(flat, tf.constant(k), tf.constant([0, 0])).numpy()
    # as PyTorch's: never more than k records (an exact top-k's bytes), at least 0.8 k
    assert 0.8 * k <= len(idx) <= k and len(set(idx)) == len(idx)
    magnitude = np.abs(flat.numpy())
    # what it picks is the largest: an exact top-k when k pass, its top 0.8 k at least
    assert magnitude[idx].min() >= np.sort(magnitude)[-k]


def test_compressors_are_hashable_and_refuse_horovods_allreduce_path():
    assert hash(Compression.dgc) == hash(Compression.dgc())
    assert {Compression.dgc: 1}[Compression.dgc()] == 1
    with pytest.raises(TypeError, match="hvd_dgc"):
        Compression.dgc.compress(tf.ones([3]))


def test_in_graph_density_schedule_equals_the_python_schedule():
    for unit in ("epoch", "step"):
        ex = GradientExchange(density=0.001, warmup=4, warmup_unit=unit)
        ex.step, ex.epoch = tf.Variable(0, dtype=tf.int64), tf.Variable(0.0)
        py = DensitySchedule(0.001, 4, unit)
        for t in [0, 0.5, 1, 1.99, 2, 3, 3.999, 4, 10]:
            if unit == "step" and t != int(t):
                continue
            ex.step.assign(int(t))
            ex.epoch.assign(t)
            assert float(ex.density().numpy()) == py(int(t), t), (unit, t)


def test_max_sparse_k_is_the_cost_models_break_even():
    cm = CostModel()
    for numel, world in [(10_000, 2), (10_000, 8), (1_000_000, 32), (1500, 4)]:
        k = cm.max_sparse_k(numel, world)
        assert cm.choose(numel, k, world) == SPARSE
        assert cm.choose(numel, k + 1, world) != SPARSE


def test_tape_memory_is_not_shared_between_different_compressor_options():
    import hvd_dgc.tensorflow as hvd
    a = hvd._options_key({"compression": Compression.dgc, "warmup_densities": [0.25]})
    b = hvd._options_key({"compression": Compression.dgc(sample_ratio=0.001),
                          "warmup_densities": [0.25]})
    assert a != b
    assert a == hvd._options_key({"compression": Compression.dgc(),
                                  "warmup_densities": [0.25]})
