"""TensorFlow side, single process: tests/core/test_reference.py's vectors give the same numbers
as the PyTorch side; packing, sampled selection and the in-graph density schedule."""

import math

import numpy as np
import pytest
import tensorflow as tf

from hvd_dgc import CostModel, DensitySchedule
from hvd_dgc.paths import PathKind

SPARSE = PathKind.ALLGATHER
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
    from hvd_dgc.tensorflow.tape_exchanges import options_key
    a = options_key({"compression": Compression.dgc, "warmup_densities": [0.25]})
    b = options_key({"compression": Compression.dgc(sample_ratio=0.001),
                     "warmup_densities": [0.25]})
    assert a != b
    assert a == options_key({"compression": Compression.dgc(),
                             "warmup_densities": [0.25]})


def test_fp16_records_are_six_bytes_and_keep_every_index():
    comp = Compression.dgc(fp16_values=True)
    assert comp.record_bytes == 6 and Compression.dgc.record_bytes == 8
    indices = tf.constant([0, 1, 65535, 65536, 70001, 2 ** 31 - 1], tf.int32)
    values = tf.constant([1.0, -2.5, 0.1, 65504.0, -3e-5, 1234.567], tf.float32)
    wire = comp.to_wire(comp.pack(values, indices))
    assert wire.dtype == tf.int16 and wire.shape == (6, 3)  # 6 bytes a record
    back = comp.from_wire(wire)
    np.testing.assert_array_equal(back[:, 0].numpy(), indices.numpy())
    expected = values.numpy().astype(np.float16).astype(np.float32)
    np.testing.assert_array_equal(tf.bitcast(back[:, 1], tf.float32).numpy(), expected)
    np.testing.assert_array_equal(comp.wire_values(values).numpy(), expected)
    plain = Compression.dgc.pack(values, indices)  # fp32 records travel as they are
    assert Compression.dgc.to_wire(plain) is plain and Compression.dgc.wire_values(values) is values


@pytest.mark.parametrize("name", ["sign", "bf16", "qsgd"])
@pytest.mark.parametrize("n", [1, 13, 1001])
def test_quantizer_payloads_are_pytorchs_byte_for_byte(name, n):
    import torch
    from hvd_dgc.torch.compression import Compression as TorchCompression
    ours, theirs = getattr(Compression, name), getattr(TorchCompression, name)
    x = np.random.RandomState(n).randn(n).astype(np.float32)
    mine = ours.encode(tf.constant(x), tf.constant([3, 0])).numpy()
    assert mine.dtype == np.uint8 and mine.size == ours.payload_bytes(n) == \
        theirs.payload_bytes(n)
    # either framework decodes the other's payload to the same values
    np.testing.assert_array_equal(
        ours.decode(tf.constant(mine), n).numpy(),
        theirs.decode(torch.from_numpy(mine), n, torch.float32).numpy())
    if name != "qsgd":  # deterministic: the same bytes (sign's scale: within its last bit)
        other = theirs.encode(torch.from_numpy(x)).numpy()
        skip = 4 if name == "sign" else 0
        np.testing.assert_array_equal(mine[skip:], other[skip:])
        np.testing.assert_allclose(mine[:skip].view(np.float32), other[:skip].view(np.float32),
                                   rtol=2.5e-7)
    if name == "sign":  # scale * sign, scale = mean |x|
        np.testing.assert_allclose(ours.decode(tf.constant(mine), n).numpy(),
                                   np.where(x >= 0, 1, -1) * np.abs(x).mean(), rtol=1e-6)


def test_qsgd_is_unbiased_and_quantizers_refuse_horovods_allreduce():
    x = tf.constant(np.random.RandomState(0).randn(256).astype(np.float32))
    q = Compression.qsgd
    mean = tf.add_n([q.decode(q.encode(x, tf.constant([s, 1])), 256) for s in range(400)]) / 400
    # E[decode] = x: the mean of 400 draws within 4 standard errors (level step / 2 / 20)
    step = np.linalg.norm(x.numpy().reshape(2, 128), axis=1).repeat(128) / 7
    assert np.all(np.abs(mean.numpy() - x.numpy()) <= 4 * step / 2 / 20)
    assert Compression.qsgd(levels=15).levels == 15
    with pytest.raises(TypeError, match="no option"):
        Compression.sign(levels=3)
    with pytest.raises(TypeError, match="hvd_dgc.tensorflow's DistributedGradientTape"):
        Compression.sign.compress(x)  # Horovod's compress/allreduce cannot carry it


class _OneRank:
    """A world of one process for a compressor's own collectives (each returns its input)."""

    def size(self):
        return 1

    def allgather(self, tensor, tag):
        return tensor

    def allreduce(self, tensor, tag, op):
        return tensor


@pytest.mark.parametrize("rank", [1, 2, 4])
def test_powersgd_follows_pytorchs_from_the_same_q(rank):
    """Three steps of error feedback through PyTorch's PowerSGD (world of one) and
    TensorFlow's, from the same first Q: the same averages and residuals up to float32
    rounding (matmuls summed in other orders; r = 4 orthogonalises by QR, whose column
    signs may differ, which P Q^T cancels)."""
    import torch
    from hvd_dgc.torch.collective import LocalComm
    from hvd_dgc.torch.compression import Compression as TorchCompression
    from hvd_dgc.tensorflow.paths import At
    shape, key = (24, 3, 5), "layer.weight"
    q0 = np.random.RandomState(1).randn(15, rank).astype(np.float32)
    theirs = TorchCompression.powersgd(rank=rank, start_iter=0)
    theirs._q[key] = torch.from_numpy(q0.copy())
    ours = Compression.powersgd(rank=rank, start_iter=0)
    slot = ours.slot(shape, key)
    slot.q.assign(q0)
    residual_torch = torch.zeros(shape)
    residual_tf = np.zeros(24 * 15, np.float32)
    for step in range(3):
        g = np.random.RandomState(10 + step).randn(*shape).astype(np.float32)
        residual_torch += torch.from_numpy(g)
        ex = theirs.launch([residual_torch], [key], "p", LocalComm())
        (avg_torch,) = theirs.collect(ex)  # takes what was sent out of residual_torch
        v = residual_tf + g.reshape(-1)
        at = At(0, 1.0, tf.constant([0, 0]), tf.constant(step, tf.int64))
        res = ours.exchange(tf.constant(v), shape, slot, _OneRank(), at)
        residual_tf = v - res.sent.numpy()
        scale = np.abs(avg_torch.numpy()).max()
        np.testing.assert_allclose(res.mean.numpy(), avg_torch.numpy(), rtol=1e-4,
                                   atol=1e-5 * scale)
        np.testing.assert_allclose(residual_tf, residual_torch.numpy().reshape(-1), rtol=1e-4,
                                   atol=1e-5 * scale)
        assert int(res.bytes) == 4 * (24 + 15) * rank  # P and Q, float32
    # the warm start: Q is the last averaged one
    np.testing.assert_allclose(slot.q.numpy(), theirs._q[key].numpy(), rtol=1e-4, atol=1e-5)


def test_powersgd_compresses_only_where_it_saves_and_starts_dense():
    from hvd_dgc.tensorflow.paths import At
    comp = Compression.powersgd(rank=2, start_iter=2)
    assert comp.compressible((64, 64)) and not comp.compressible((64,))
    assert not comp.compressible((4, 3))  # (4 + 3) * 2 * 2 >= 12: no saving
    slot = comp.slot((64, 64), "w")
    v = tf.constant(np.random.RandomState(0).randn(64 * 64).astype(np.float32))
    for step, dense in ((0, True), (1, True), (2, False)):
        res = comp.exchange(v, (64, 64), slot, _OneRank(),
                            At(0, 1.0, tf.constant([0, 0]), tf.constant(step, tf.int64)))
        assert int(res.bytes) == (4 * 64 * 64 if dense else 4 * 128 * 2)
        assert np.array_equal(res.sent.numpy(), v.numpy()) == dense
    with pytest.raises(ValueError, match="PowerSGD rank must be an int >= 1"):
        Compression.powersgd(rank=0)
