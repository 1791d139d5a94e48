"""The NumPy reference (tests/reference.py) against hand-derived vectors, then PyTorch's and
TensorFlow's memories against the reference, step by step, on the same inputs.

Tolerances. Exact (assert_array_equal) wherever a framework does the reference's float32
operations in the same order. Otherwise ``assert_close``: |a - b| <= 1e-6 |b| + 1e-6 max|b|,
about 8 float32 ulps of the tensor's largest value, against differences measured at
<= 3.2e-7 max|b| over 8 steps; a wrong formula (a missing u, an unmasked momentum) is off
by O(1). The reasons a framework is not exact are at ``exact_for``. Hand vectors are
decimals that float32 cannot hold, so they are compared at rtol 1e-6.
"""

import math
import os
import pickle
import subprocess
import sys
import tempfile

import numpy as np
import pytest
import tensorflow as tf
import torch

from hvd_dgc.adam import observed_weights, refresh_count, refreshes_at
from hvd_dgc.schedule import num_selected
from hvd_dgc.tensorflow.compression import Compression as TFCompression
from hvd_dgc.tensorflow.memory import DGCMemory as TFMemory
from hvd_dgc.tensorflow.memory import local_gradient as tf_local_gradient
from hvd_dgc.torch.compression import Compression as TorchCompression
from hvd_dgc.torch import memory as memory_module
from hvd_dgc.torch.memory import local_gradient as torch_local_gradient
from tests.flatmem import OneTensor
from tests import reference as ref
from tests.reference import F32
from harness.hvdrun import REPO, worker_env
from tests.core import reference_guard as guard

G = [0.5, -2.0, 0.1, 1.0]


def assert_close(actual, expected, err_msg=""):
    """Equal up to float32 rounding (module docstring): rtol 1e-6 plus 1e-6 of the largest
    |expected|, as values that cancel towards 0 keep the absolute error of their inputs."""
    expected = np.asarray(expected, np.float32)
    scale = float(np.abs(expected).max()) if expected.size else 0.0
    np.testing.assert_allclose(actual, expected, rtol=1e-6, atol=1e-6 * scale, err_msg=err_msg)


def assert_hand(records, sent, u=None, v=None):
    """A trace against hand-derived (index, value) pairs and final buffers (decimals)."""
    assert [int(r.indices[0]) for r in records] == [i for i, _ in sent]
    np.testing.assert_allclose([float(r.values[0]) for r in records], [x for _, x in sent],
                               rtol=1e-6)
    if u is not None:
        np.testing.assert_allclose(records[-1].u, u, rtol=1e-6, atol=1e-7)
    if v is not None:
        np.testing.assert_allclose(records[-1].v, v, rtol=1e-6, atol=1e-7)


# -- hand-derived test vectors -----------------------------------------------------------
# G = [0.5, -2.0, 0.1, 1.0] every step, m = 0.9, k = 1 (the largest |v| is sent).
def test_vector_momentum_with_masking():
    # step 1: u = 0.9*0 + G             = [0.5,   -2.0, 0.1,   1.0]
    #         v = 0 + u                 = [0.5,   -2.0, 0.1,   1.0]    send (1, -2.0)
    #         mask: u[1] = v[1] = 0  ->  u = [0.5, 0, 0.1, 1.0], v = [0.5, 0, 0.1, 1.0]
    # step 2: u = 0.9*u + G             = [0.95,  -2.0, 0.19,  1.9]
    #         v = v + u                 = [1.45,  -2.0, 0.29,  2.9]    send (3, 2.9)
    #         mask: u = [0.95, -2.0, 0.19, 0], v = [1.45, -2.0, 0.29, 0]
    # step 3: u = 0.9*u + G             = [1.355, -3.8, 0.271, 1.0]
    #         v = v + u                 = [2.805, -5.8, 0.561, 1.0]    send (1, -5.8)
    #         mask: u = [1.355, 0, 0.271, 1.0], v = [2.805, 0, 0.561, 1.0]
    records = ref.run([G] * 3, k=1, momentum=0.9, masking=True)
    assert_hand(records, [(1, -2.0), (3, 2.9), (1, -5.8)],
                u=[1.355, 0, 0.271, 1.0], v=[2.805, 0, 0.561, 1.0])
    np.testing.assert_allclose(records[1].u, [0.95, -2.0, 0.19, 0], rtol=1e-6)
    np.testing.assert_allclose(records[1].v, [1.45, -2.0, 0.29, 0], rtol=1e-6)


def test_vector_momentum_without_masking():
    # step 1: u = [0.5, -2.0, 0.1, 1.0]; v = u; send (1, -2.0); v[1] = 0 (u kept)
    #         u = [0.5, -2.0, 0.1, 1.0], v = [0.5, 0, 0.1, 1.0]
    # step 2: u = 0.9*u + G = [0.95, -3.8, 0.19, 1.9]
    #         v = v + u     = [1.45, -3.8, 0.29, 2.9]       send (1, -3.8): |-3.8| > 2.9
    #         v = [1.45, 0, 0.29, 2.9]
    # step 3: u = 0.9*u + G = [1.355, -5.42, 0.271, 2.71]
    #         v = v + u     = [2.805, -5.42, 0.561, 5.61]   send (3, 5.61)
    #         v = [2.805, -5.42, 0.561, 0]
    records = ref.run([G] * 3, k=1, momentum=0.9, masking=False)
    assert_hand(records, [(1, -2.0), (1, -3.8), (3, 5.61)],
                u=[1.355, -5.42, 0.271, 2.71], v=[2.805, -5.42, 0.561, 0])


def test_vector_nesterov_with_masking():
    # Nesterov: u = m (u + g); v = v + (u + g).
    # step 1: u = 0.9*G              = [0.45,   -1.8,  0.09,   0.9]
    #         v = u + G              = [0.95,   -3.8,  0.19,   1.9]    send (1, -3.8)
    #         mask: u = [0.45, 0, 0.09, 0.9], v = [0.95, 0, 0.19, 1.9]
    # step 2: u + G                  = [0.95,   -2.0,  0.19,   1.9]
    #         u = 0.9*(u + G)        = [0.855,  -1.8,  0.171,  1.71]
    #         v = v + (u + G)        = [2.305,  -3.8,  0.461,  4.61]   send (3, 4.61)
    #         mask: u = [0.855, -1.8, 0.171, 0], v = [2.305, -3.8, 0.461, 0]
    # step 3: u + G                  = [1.355,  -3.8,  0.271,  1.0]
    #         u = 0.9*(u + G)        = [1.2195, -3.42, 0.2439, 0.9]
    #         v = v + (u + G)        = [4.0245, -9.22, 0.8049, 1.9]    send (1, -9.22)
    #         mask: u = [1.2195, 0, 0.2439, 0.9], v = [4.0245, 0, 0.8049, 1.9]
    records = ref.run([G] * 3, k=1, momentum=0.9, nesterov=True, masking=True)
    assert_hand(records, [(1, -3.8), (3, 4.61), (1, -9.22)],
                u=[1.2195, 0, 0.2439, 0.9], v=[4.0245, 0, 0.8049, 1.9])


def test_vector_error_feedback_loses_nothing():
    # m = 0: v = v + g. G2 = [0.5, -2.0, 0.1, 1.5] (1.5, not 1.0: no tie at step 2).
    # step 1: v = [0.5, -2.0, 0.1, 1.5]   send (1, -2.0)  -> v = [0.5, 0, 0.1, 1.5]
    # step 2: v = [1.0, -2.0, 0.2, 3.0]   send (3, 3.0)   -> v = [1.0, -2.0, 0.2, 0]
    # step 3: v = [1.5, -4.0, 0.3, 1.5]   send (1, -4.0)  -> v = [1.5, 0, 0.3, 1.5]
    # sent (-2 + 3 - 4 = -3 at their places) + residual == 3 * G2: nothing lost.
    g2 = [0.5, -2.0, 0.1, 1.5]
    records = ref.run([g2] * 3, k=1)
    assert_hand(records, [(1, -2.0), (3, 3.0), (1, -4.0)], u=[0, 0, 0, 0], v=[1.5, 0, 0.3, 1.5])
    total = sum(ref.scatter(r.indices, r.values, 4) for r in records) + records[-1].v
    np.testing.assert_allclose(total, 3 * np.float32(g2), rtol=1e-6)


def test_vector_clipping_is_exact_in_every_framework():
    # g = [30, 40]: ||g|| = sqrt(900 + 1600) = 50, and 50 + 1e-6 rounds to 50 in float32
    # (half an ulp of 50 is 1.9e-6), so every step below is exact in float32.
    # N = 4, clip_norm = 50: limit = 50 / sqrt(4) = 25; scale = min(1, 25 / 50) = 0.5
    #   -> [15, 20].  Weight decay 0.25, p = [2, -4] (PyTorch): [15 + 0.5, 20 - 1] = [15.5, 19].
    # N = 1, clip_norm = 100: scale = min(1, 100 / 50) = 1 -> unchanged.
    g, p = [30.0, 40.0], [2.0, -4.0]
    cases = [(50.0, 4, [15.0, 20.0]), (100.0, 1, [30.0, 40.0]), (None, 1, [30.0, 40.0])]
    for clip, world, expected in cases:
        np.testing.assert_array_equal(ref.local_gradient(g, clip, world), expected)
        np.testing.assert_array_equal(
            torch_local_gradient(torch.tensor(g), torch.tensor(p), 0.0, clip, world).numpy(),
            expected)
        np.testing.assert_array_equal(tf_local_gradient(tf.constant(g), clip, world).numpy(),
                                      expected)
    np.testing.assert_array_equal(ref.local_gradient(g, 50.0, 4, 0.25, p), [15.5, 19.0])
    np.testing.assert_array_equal(
        torch_local_gradient(torch.tensor(g), torch.tensor(p), 0.25, 50.0, 4).numpy(),
        [15.5, 19.0])


def test_vector_delayed_averaging():
    # D = 2, two ranks. own (one number per step): rank 0 [1, 2, 3, 4, 5], rank 1
    # [3, 1, 4, 1, 5]; avg = [2, 1.5, 3.5, 2.5, 5].  update_i = own_i - own_(i-2) + avg_(i-2):
    #   rank 0: 1, 2, 3-1+2 = 4, 4-2+1.5 = 3.5, 5-3+3.5 = 5.5      (sum 16)
    #   rank 1: 3, 1, 4-3+2 = 3, 1-1+1.5 = 1.5, 5-4+3.5 = 4.5      (sum 13)
    # Sums telescope to avg_0..2 (7) + own_3 + own_4: 7 + 9 = 16, 7 + 6 = 13. The flush
    # then adds avg_i - own_i for i = 3, 4: rank 0 16 - 1.5 + 0 = 14.5, rank 1 13 + 1.5 + 0
    # = 14.5 = sum(avg): both ranks end where synchronous averaging does.
    own = [[1, 2, 3, 4, 5], [3, 1, 4, 1, 5]]
    avg = [ref.average([[own[0][i]], [own[1][i]]]) for i in range(5)]
    np.testing.assert_array_equal(np.concatenate(avg), [2, 1.5, 3.5, 2.5, 5])
    expected = [[1, 2, 4, 3.5, 5.5], [3, 1, 3, 1.5, 4.5]]
    for rank in range(2):
        history = [[x] for x in own[rank]]
        updates = [float(ref.dga_update(history, avg, i, 2)[0]) for i in range(5)]
        assert updates == expected[rank]
        flushed = sum(updates) + sum(float(avg[i][0]) - own[rank][i] for i in (3, 4))
        assert flushed == 14.5


def test_vector_temporally_sparse_updates():
    # p = 2, D = 1, two ranks; own (one number per step): rank 0 [1, 2, 3, 4, 5], rank 1
    # [3, 1, 4, 1, 5]. Exchanges at steps 1 and 3 (avg 1.5 and 2.5), applied at 2 and 4,
    # each in place of its period's own steps:
    #   rank 0: 1, 2, 3 + (1.5 - (1 + 2)) = 1.5, 4, 5 + (2.5 - (3 + 4)) = 0.5    (sum 9)
    #   rank 1: 3, 1, 4 + (1.5 - (3 + 1)) = 1.5, 1, 5 + (2.5 - (4 + 1)) = 2.5    (sum 9)
    # = avg_1 + avg_3 + own_4. The flush takes step 4's own back (after the last
    # exchange: still in the memory): 9 - 5 = 4 = avg_1 + avg_3 on both ranks.
    own = [[1, 2, 3, 4, 5], [3, 1, 4, 1, 5]]
    avg = [None, [1.5], None, [2.5], None]
    expected = [[1, 2, 1.5, 4, 0.5], [3, 1, 1.5, 1, 2.5]]
    assert ref.lag_due(5, 1, 2) == {1: 2, 3: 4}
    for rank in range(2):
        history = [[x] for x in own[rank]]
        updates = [float(ref.lagged_update(history, avg, i, 1, 2)[0]) for i in range(5)]
        assert updates == expected[rank]
        assert sum(updates) + float(ref.lagged_flush(history, avg, 5, 1, 2)[0]) == 4.0
    # delay="auto" (a D per step): exchange 1 ran under D = 2, exchange 3 under D = 0,
    # which must wait for the one before it: both applied at step 3
    assert ref.lag_due(5, [2, 2, 0, 0, 0], 2) == {1: 3, 3: 3}
    # period 1 is delayed averaging: the DGA vector above, step by step
    own, dense_avg = [1, 2, 3, 4, 5], [[2], [1.5], [3.5], [2.5], [5]]
    history = [[x] for x in own]
    assert [float(ref.lagged_update(history, dense_avg, i, 2, 1)[0]) for i in range(5)] == \
        [float(ref.dga_update(history, dense_avg, i, 2)[0]) for i in range(5)]


def test_vector_own_steps_taken_back_at_their_step_size():
    # p = 2, D = 0, one rank, own [1, 2, 3, 4], averages 1.5 (step 1) and 2.5 (step 3).
    # (a) rates [1, 2, 2, 4] (a schedule, or Adam's 1/(1 - beta1^t)), no decay: step 1
    # takes step 0's own back at 1/2: 2 - 1/2 + (1.5 - 2) = 1.0; step 3: 4 - 3 (2/4) +
    # (2.5 - 4) = 1.0. Displacements rate * update: 1, 2, 6, 4: after step 1 3 = 2 *
    # 1.5 and after step 3 13 = 3 + 4 * 2.5, each exchange's average at its own rate
    # and no own step left; taken back at the exchange's rate (the rule before) they
    # would leave 1 - 2 = -1 and 6 - 12 = -6 with this rank.
    own, avg = [[1], [2], [3], [4]], [None, [1.5], None, [2.5]]
    rates = [(1.0, 0.0), (2.0, 0.0), (2.0, 0.0), (4.0, 0.0)]
    updates = [float(ref.lagged_update(own, avg, i, 0, 2, rates)[0]) for i in range(4)]
    assert updates == [1.0, 1.0, 3.0, 1.0]
    assert [sum(r * u for (r, _), u in zip(rates[:n], updates[:n])) for n in (2, 4)] == \
        [3.0, 13.0]
    assert [float(ref.lagged_update(own, avg, i, 0, 2)[0]) for i in range(4)] == \
        [1.0, 0.5, 3.0, -0.5]  # (displacements 1, 1, 6, -2: 2 and 6 in place of 3, 13)
    # (b) rate 1 and a decoupled decay halving the weights at every step (log_decay
    # -ln 2 a step): step 0's own, halved by step 1's decay, is taken back at 1/2:
    # x = 0.5 * 1 + (2 - 0.5 + (1.5 - 2)) = 1.5 = avg_1, as if the average had been
    # applied at step 1 in place of both own steps.
    halving = [(1.0, -j * math.log(2.0)) for j in range(4)]
    assert ref.take_back(halving[0], halving[1]) == 0.5
    assert float(ref.lagged_update(own, avg, 1, 0, 2, halving)[0]) == 1.0
    # the flush after step 2 takes step 2's own back at the flush's size: rate 4 now,
    # step 2 at 2: -3 * 1/2
    assert float(ref.lagged_flush(own, avg, 3, 0, 2, rates, (4.0, 0.0))[0]) == -1.5
    assert ref.take_back((1.0, 0.0), (0.0, 0.0)) == 1.0  # a step of rate 0 moves nothing


def test_vector_period_memory():
    # momentum 0.5, dense, period 2, one rank, g = 1, 2, 4: step 0 (between exchanges)
    # u = 1, v = 1, own = u = 1; step 1 (exchange) u = 0.5 + 2 = 2.5, v = 3.5, sends
    # all of v: own 3.5, v = 0, u kept; step 2: u = 1.25 + 4 = 5.25, v = 5.25, own 5.25
    u = v = np.zeros(1, np.float32)
    owns = []
    for i, g in enumerate((1.0, 2.0, 4.0)):
        u, v, own = ref.lagged_memory_step(u, v, np.float32([g]), (i + 1) % 2 == 0,
                                           momentum=0.5)
        owns.append(float(own[0]))
    assert owns == [1.0, 3.5, 5.25] and float(u[0]) == 5.25 and float(v[0]) == 5.25
    # sparse: k = 1 of [3, -5, 1] sends -5 (top |v|), clears it and (masking) its u
    u, v, own = ref.lagged_memory_step(np.zeros(3, np.float32), np.zeros(3, np.float32),
                                       np.float32([3, -5, 1]), True, k=1, momentum=0.9)
    assert own.tolist() == [0, -5, 0] and v.tolist() == [3, 0, 1] and u.tolist() == [3, 0, 1]


def test_vector_sign_compression_keeps_what_it_did_not_send():
    # v = [0.5, -1.5, 0, 2]: mean |v| = 1, so the scaled signs are [1, -1, 1, 1] (0 counts +)
    assert ref.sign_sent(np.float32([0.5, -1.5, 0, 2])).tolist() == [1, -1, 1, 1]
    # a step of the memory, momentum 0.5, u = [2, 0, 0, 0], v = 0, g = [-1.5, -1.5, 0, 2]:
    #   u = 0.5 u + g = [-0.5, -1.5, 0, 2];  v = v + u = [-0.5, -1.5, 0, 2]
    #   mean |v| = 1: sent [-1, -1, 1, 1]; kept v - sent = [0.5, -0.5, -1, 1]; u unmasked
    u, v, own = ref.lagged_memory_step(np.float32([2, 0, 0, 0]), np.zeros(4, np.float32),
                                       np.float32([-1.5, -1.5, 0, 2]), True, momentum=0.5,
                                       compress=ref.sign_sent)
    assert own.tolist() == [-1, -1, 1, 1] and v.tolist() == [0.5, -0.5, -1, 1]
    assert u.tolist() == [-0.5, -1.5, 0, 2]
    # what was kept goes out later: the next step with g = 0 (u decays to half)
    u, v, own = ref.lagged_memory_step(u, v, np.zeros(4, np.float32), True, momentum=0.5,
                                       compress=ref.sign_sent)
    # v = [0.5, -0.5, -1, 1] + [-0.25, -0.75, 0, 1] = [0.25, -1.25, -1, 2], mean |v| = 1.125
    assert own.tolist() == [1.125, -1.125, -1.125, 1.125]
    assert v.tolist() == [-0.875, -0.125, 0.125, 0.875]


def test_vector_frozen_adam():
    # x0 = [1, 2], lr = 0.1, betas (0.5, 0.75), eps = 0, no weight decay; freeze after step 1.
    # step 1 (exact Adam), g1 = [2, -4]:
    #   m1 = 0.5 g1 = [1, -2];  v1 = 0.25 g1^2 = [1, 4]
    #   bias corrections 1 - 0.5 = 0.5, 1 - 0.75 = 0.25: m^ = [2, -4], v^ = [4, 16]
    #   x1 = x0 - 0.1 [2/2, -4/4] = [0.9, 2.1]
    # freeze: P = 1/sqrt(v^) = [0.5, 0.25]; the memory's momentum starts at u = P m1 = [0.5, -0.5]
    # step 2 (frozen), g2 = [4, 8]:
    #   g' = (1 - 0.5) P g2 = [1, 1];  u = 0.5 u + g' = [1.25, 0.75]   (dense: avg = u)
    #   x2 = x1 - 0.1 / (1 - 0.25) u = [0.9 - 1/6, 2.1 - 0.1] = [0.73333, 2.0]
    #   (Adam with v frozen: m2 = 0.5 m1 + 0.5 g2 = [2.5, 3], m^ = m2 / 0.75,
    #    x1 - 0.1 P m^ = [0.9 - 0.16667, 2.1 - 0.1]: the same)
    betas = (0.5, 0.75)
    x1, m1, v1 = ref.adam([1, 2], [0, 0], [0, 0], [2, -4], 1, 0.1, betas, eps=0.0)
    np.testing.assert_allclose(x1, [0.9, 2.1], rtol=1e-6)
    np.testing.assert_allclose(m1, [1, -2], rtol=1e-6)
    np.testing.assert_allclose(v1, [1, 4], rtol=1e-6)
    p = ref.frozen_precondition(v1, 1, betas, eps=0.0)
    np.testing.assert_allclose(p, [0.5, 0.25], rtol=1e-6)
    g = ref.frozen_adam_gradient([4, 8], p, betas[0])
    np.testing.assert_allclose(g, [1, 1], rtol=1e-6)
    u, _ = ref.accumulate(p * m1, [0, 0], g, momentum=betas[0])
    np.testing.assert_allclose(u, [1.25, 0.75], rtol=1e-6)
    x2 = ref.frozen_adam_apply(x1, u, 2, 0.1, betas[0])
    np.testing.assert_allclose(x2, [0.9 - 1 / 6, 2.0], rtol=1e-6)


def test_vector_refreshed_precondition():
    # betas (0.5, 0.75), eps = 0, floor 0, refreshed at the end of step t = 2 (bias
    # correction 1 - 0.75^2 = 0.4375) from P = [0.5, 0.25] (test_vector_frozen_adam's):
    #   the ranks' own v [1, 12] and [13, 2] average to [7, 7]; v^ = 7 / 0.4375 = 16
    #   P' = 1 / sqrt(16) = [0.25, 0.25]; the memory's ratio P' / P = [0.5, 1]
    average_v, new, ratio = ref.refreshed_precondition(
        [np.float32([1, 12]), np.float32([13, 2])], [0.5, 0.25], 2, (0.5, 0.75), 0.0, 0.0)
    np.testing.assert_allclose(average_v, [7, 7], rtol=1e-6)
    np.testing.assert_allclose(new, [0.25, 0.25], rtol=1e-6)
    np.testing.assert_allclose(ratio, [0.5, 1.0], rtol=1e-6)


def test_vector_observed_square():
    # 2 ranks: g^2 / 2 + g g_previous / 2; 1 rank: g^2 (Adam's own)
    #   no previous gradient (zeros): [2, 4] -> [4, 16] / 2 = [2, 8]
    #   then [2, -4] after [2, 4]: [2, 8] + [4, -16] / 2 = [4, 0]
    np.testing.assert_allclose(ref.observed_square([2, 4], [0, 0], 2), [2, 8])
    np.testing.assert_allclose(ref.observed_square([2, -4], [2, 4], 2), [4, 0])
    np.testing.assert_allclose(ref.observed_square([2, -4], [2, 4], 1), [4, 16])
    # the product's weights are the shared rule both frameworks use
    assert observed_weights(2) == (0.5, 0.5) and observed_weights(1) == (1.0, 0.0)
    assert observed_weights(8) == (0.125, 0.875)
    # a refreshed average below zero is taken as 0 (the floor then applies)
    average_v, _, _ = ref.refreshed_precondition(
        [np.float32([-3, 4]), np.float32([1, 4])], [1.0, 1.0], 1, (0.5, 0.5), 0.0, 0.01)
    np.testing.assert_allclose(average_v, [0, 4])


@pytest.mark.parametrize("world", [2, 4])
def test_observed_square_averages_to_the_average_gradients_second_moment(world):
    """Gradients g = mu + sigma z, each rank its own noise at every step (the weights held
    still): the ranks' average of the tracked v (``observed_square``, beta2 0.999 over
    6,000 steps) estimates the moving average of the average gradient's square, mu^2 +
    sigma^2 / N, where each rank's own g^2 reads mu^2 + sigma^2."""
    rng = np.random.default_rng(3)
    mu = np.float32([0.0, 0.1, 0.3, 1.0, -0.5, 0.02])
    sigma, beta2, steps = F32(0.5), 0.999, 6000
    tracked = [np.zeros(6, np.float32) for _ in range(world)]
    own = [np.zeros(6, np.float32) for _ in range(world)]
    previous = [np.zeros(6, np.float32) for _ in range(world)]
    exact = np.zeros(6, np.float32)
    for _ in range(steps):
        grads = [mu + sigma * rng.standard_normal(6).astype(np.float32) for _ in range(world)]
        mean = ref.average(grads)
        exact = F32(beta2) * exact + F32(1 - beta2) * mean * mean
        for r, g in enumerate(grads):
            tracked[r] = F32(beta2) * tracked[r] + \
                F32(1 - beta2) * ref.observed_square(g, previous[r], world)
            own[r] = F32(beta2) * own[r] + F32(1 - beta2) * g * g
            previous[r] = g
    target = (mu * mu + sigma * sigma / world) * F32(1 - beta2 ** steps)
    estimate, owns = ref.average(tracked), ref.average(own)
    np.testing.assert_allclose(exact, target, rtol=0.1, atol=0.01)  # (the sampling noise)
    np.testing.assert_allclose(estimate, target, rtol=0.1, atol=0.01)
    # the rank's own square reads the noise N times: 0.25 against 0.25 / N where mu = 0
    assert float(owns[0]) > 0.9 * float(sigma * sigma) * (1 - beta2 ** steps)
    assert float(owns[0]) > (world - 0.5) * float(target[0])


def test_refreshed_every_step_is_adam_with_its_variance_one_step_late():
    """One rank, dense, the variance refreshed at the end of every step after the
    freeze: the memory's momentum is P_(t-1) m_t at each step, so the run is AdamW whose
    preconditioner is the previous step's (and exact Adam to the freeze)."""
    rng = np.random.default_rng(7)
    betas, lr, eps, wd, freeze, steps = (0.9, 0.99), 0.05, 1e-8, 0.01, 3, 10
    x0 = rng.standard_normal(6).astype(np.float32)
    grads = rng.standard_normal((steps, 6)).astype(np.float32)
    out, _ = ref.delayed_frozen_adam([x0], lambda x, step, r: [grads[step]], steps, 1,
                                     freeze, lr, betas, eps, wd, 0, 0.0,
                                     refresh=set(range(freeze + 1, steps + 1)))
    x, m, v = x0.copy(), np.zeros(6, np.float32), np.zeros(6, np.float32)
    for t in range(1, steps + 1):
        g = grads[t - 1]
        if t <= freeze:
            x, m, v = ref.adam(x, m, v, g, t, lr, betas, eps, wd, True)
        else:
            late = ref.frozen_precondition(v, t - 1, betas, eps)  # v of step t - 1
            m = F32(betas[0]) * m + F32(1 - betas[0]) * g
            x = x * F32(1 - lr * wd) - F32(lr / (1 - betas[0] ** t)) * late * m
            v = F32(betas[1]) * v + F32(1 - betas[1]) * g * g
        np.testing.assert_allclose(out[0][t - 1][0], x, rtol=1e-5, atol=1e-6)
    frozen, _ = ref.delayed_frozen_adam([x0], lambda x, step, r: [grads[step]], steps, 1,
                                        freeze, lr, betas, eps, wd, 0, 0.0)
    assert float(np.abs(frozen[0][-1][0] - out[0][-1][0]).max()) > 1e-4  # it refreshed


def test_refresh_steps_are_agreed_by_rule():
    """0/1 Adam's growing intervals ('auto': 2T, 4T, 8T, ...) or every k steps, from the
    freeze at step T; never before it, never with False."""
    auto = [t for t in range(1, 400) if refreshes_at(t, 20, "auto")]
    assert auto == [40, 80, 160, 320]
    assert [t for t in range(1, 400) if refreshes_at(t, 20, 100)] == [120, 220, 320]
    assert not any(refreshes_at(t, 20, False) for t in range(400))
    assert [t for t in range(1, 10) if refreshes_at(t, 1, "auto")] == [2, 4, 8]
    for freeze, refresh in ((20, "auto"), (20, 100), (3, 2), (1, "auto"), (20, False)):
        assert [refresh_count(t, freeze, refresh) for t in range(400)] == \
            [sum(refreshes_at(s, freeze, refresh) for s in range(1, t + 1))
             for t in range(400)], (freeze, refresh)
        # Keras' graph asks the same rule in TF ops (tensorflow/adam.py ``refreshing``)
        from hvd_dgc.tensorflow.adam import AdamTakeOver
        adam = AdamTakeOver({"beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-7}, freeze,
                                 "keras3", refresh)
        assert [bool(adam.refreshing(tf.constant(t, tf.int64))) for t in range(400)] == \
            [refreshes_at(t, freeze, refresh) for t in range(400)], (freeze, refresh)


def test_vector_frozen_keras_adam():
    # Keras adds eps outside the bias correction. x0 = [1, 2], lr = 0.1, betas (0.5, 0.75),
    # eps = 0.5, no decay; freeze after step 1, g1 = [2, -4]:
    #   m1 = [1, -2], v1 = [1, 4] (as above); sqrt(1 - 0.75) = 0.5
    #   alpha = 0.1 * 0.5 / 0.5 = 0.1;  x1 = x0 - 0.1 m1 / (sqrt(v1) + 0.5)
    #                                      = [1 - 0.1 / 1.5, 2 + 0.2 / 2.5] = [0.93333, 2.08]
    # freeze: P = 1 / (sqrt(v1 / 0.25) + 0.5 / 0.5) = [1 / 3, 1 / 5] (torch's eps: [0.4, 0.2222])
    # Keras' step 1 again from P: x0 - 0.1 / (1 - 0.5) P m1 = [1 - 0.2 / 3, 2 + 0.08]: the same
    betas = (0.5, 0.75)
    x1, m1, v1 = ref.keras_adam([1, 2], [0, 0], [0, 0], [2, -4], 1, 0.1, betas, eps=0.5)
    np.testing.assert_allclose(x1, [1 - 0.1 / 1.5, 2.08], rtol=1e-6)
    p = ref.frozen_precondition(v1, 1, betas, eps=0.5, keras=True)
    np.testing.assert_allclose(p, [1 / 3, 1 / 5], rtol=1e-6)
    np.testing.assert_allclose(ref.frozen_precondition(v1, 1, betas, eps=0.5), [0.4, 1 / 4.5],
                               rtol=1e-6)
    np.testing.assert_allclose(ref.frozen_adam_apply([1, 2], p * m1, 1, 0.1, betas[0]), x1,
                               rtol=1e-6)


def test_reference_keras_adam_is_keras_adam_and_adamw():
    """ref.keras_adam against Keras' own Adam and AdamW (decoupled decay before the step,
    eps outside the bias correction), step by step: the warm-up Keras keeps."""
    import tensorflow as tf
    rng = np.random.default_rng(5)
    grads = rng.standard_normal((6, 5)).astype(np.float32)
    for wd in (0.0, 0.1):
        x0 = rng.standard_normal(5).astype(np.float32)
        var = tf.Variable(x0)
        opts = tf.keras.optimizers
        opt = opts.AdamW(0.01, weight_decay=wd, beta_1=0.8, beta_2=0.95, epsilon=1e-3) if wd \
            else opts.Adam(0.01, beta_1=0.8, beta_2=0.95, epsilon=1e-3)
        x, m, v = x0, np.zeros(5, np.float32), np.zeros(5, np.float32)
        for t, g in enumerate(grads, 1):
            opt.apply_gradients([(tf.constant(g), var)])
            x, m, v = ref.keras_adam(x, m, v, g, t, 0.01, (0.8, 0.95), 1e-3, wd)
            np.testing.assert_allclose(var.numpy(), x, rtol=1e-6, atol=1e-7)


def test_reference_adam_is_torchs_adam_and_adamw():
    """ref.adam against torch's own Adam and AdamW (L2 and decoupled decay, bias
    corrections), step by step: the warm-up the take-over leaves to the user's optimizer."""
    rng = np.random.default_rng(3)
    grads = rng.standard_normal((6, 5)).astype(np.float32)
    for cls, decoupled in ((torch.optim.Adam, False), (torch.optim.AdamW, True)):
        x0 = rng.standard_normal(5).astype(np.float32)
        p = torch.nn.Parameter(torch.tensor(x0))
        opt = cls([p], lr=0.01, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, foreach=False)
        x, m, v = x0, np.zeros(5, np.float32), np.zeros(5, np.float32)
        for t, g in enumerate(grads, 1):
            p.grad = torch.tensor(g)
            opt.step()
            x, m, v = ref.adam(x, m, v, g, t, 0.01, (0.8, 0.95), 1e-6, 0.1, decoupled)
            np.testing.assert_allclose(p.detach().numpy(), x, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(opt.state[p]["exp_avg_sq"].numpy(), v, rtol=1e-6)


def test_frozen_adam_at_density_one_is_adam_with_v_frozen():
    """DGC's dense path on the scaled gradient, the momentum seeded with P m, equals Adam
    whose v stopped at the freeze (the claim of hvd_dgc/adam.py), with L2 decay."""
    rng = np.random.default_rng(4)
    betas, lr, eps, wd, freeze = (0.9, 0.99), 0.05, 1e-8, 0.01, 3
    x = rng.standard_normal(6).astype(np.float32)
    m, v = np.zeros(6, np.float32), np.zeros(6, np.float32)
    grads = rng.standard_normal((10, 6)).astype(np.float32)
    for t in range(1, freeze + 1):
        x, m, v = ref.adam(x, m, v, grads[t - 1], t, lr, betas, eps, wd)
    p = ref.frozen_precondition(v, freeze, betas, eps)
    adam_x, adam_m = x.copy(), m.copy()
    dgc_x, u, res = x.copy(), p * m, np.zeros(6, np.float32)
    for t in range(freeze + 1, 11):
        g = grads[t - 1]
        adam_m = F32(betas[0]) * adam_m + F32(1 - betas[0]) * (g + F32(wd) * adam_x)
        adam_x = adam_x - F32(lr / (1 - betas[0] ** t)) * adam_m * p
        u, res = ref.accumulate(u, res, ref.frozen_adam_gradient(g, p, betas[0], wd, dgc_x),
                                momentum=betas[0])
        avg = res
        u, res = ref.sent_all(u, res)
        dgc_x = ref.frozen_adam_apply(dgc_x, avg, t, lr, betas[0])
        np.testing.assert_allclose(dgc_x, adam_x, rtol=1e-5, atol=1e-6)
    assert float(np.abs(dgc_x - x).max()) > 1e-2  # it moved


def test_num_selected_rule_is_hvd_dgcs():
    # ceil(numel * density), at least 1, at most numel
    assert [ref.num_selected(n, d) for n, d in
            [(100, 0.001), (1000, 0.001), (1001, 0.001), (64, 0.0625), (5, 1.0)]] == \
        [1, 1, 2, 4, 5]
    for numel in (1, 7, 100, 1001, 123457):
        for density in (0.0001, 0.001, 0.0625, 0.25, 0.5, 1.0):
            assert ref.num_selected(numel, density) == num_selected(numel, density)


def test_top_k_breaks_ties_by_lower_index_and_frameworks_pick_the_same_set():
    np.testing.assert_array_equal(ref.top_k([1.0, -3.0, 3.0, 2.0], 2), [1, 2])
    np.testing.assert_array_equal(ref.top_k([0.5, -2.0, 0.1, 1.0], 3), [1, 3, 0])
    v = np.random.RandomState(3).randn(1000).astype(np.float32)  # no ties
    for k in (1, 10, 100):
        expected = sorted(ref.top_k(v, k).tolist())
        assert sorted(TorchCompression.topk.select(torch.tensor(v), k).tolist()) == expected
        assert sorted(TFCompression.topk.select(tf.constant(v), k, None).numpy().tolist()) \
            == expected


# -- parity: the same gradients through the reference, PyTorch and TensorFlow ------------
NUMEL, STEPS, DENSITY, CLIP = 100, 8, 0.05, 15.0


def exact_for(subject, momentum, nesterov, clip_norm):
    """Does ``subject`` do the reference's float32 operations in the same order?"""
    if clip_norm is not None:
        return False  # ||g|| is summed in another order: the clip scale's last bits differ
    if subject == "tf" or not momentum:
        return True
    if subject == "torch":
        return False  # torch.add(g, u, alpha=m) is one fused multiply-add (one rounding)
    return not nesterov  # the C++ kernel (and eager torch) add v + u + g as (v + u) + g


def parity_grads(seed=1):
    """Per-step gradients of varying norm (5 to 20), so clip_norm=15 clips some steps."""
    rng = np.random.RandomState(seed)
    return [(rng.randn(NUMEL) * rng.uniform(0.5, 2.0)).astype(np.float32)
            for _ in range(STEPS)]


class TorchSubject:
    """hvd_dgc.torch: local_gradient, then DGCMemory (eager, or the fused C++ kernel)."""

    def __init__(self, momentum, nesterov, masking, fused):
        self.mem = OneTensor(NUMEL, masking, momentum, nesterov)
        self.fused = fused

    def local_gradient(self, g, clip_norm, world):
        return torch_local_gradient(torch.tensor(g), torch.zeros(len(g)), 0.0, clip_norm, world)

    def accumulate(self, g):
        """-> (v, block maxima or None): the kernel, or eager PyTorch without it"""
        if self.fused:
            v, block_max = self.mem.accumulate(g, with_block_max=True)
            return v.numpy().copy(), block_max.numpy()
        saved, memory_module._fused_memory = memory_module._fused_memory, None
        try:
            return self.mem.accumulate(g).numpy().copy(), None
        finally:
            memory_module._fused_memory = saved

    def sent(self, indices):
        self.mem.sent(torch.tensor(indices))

    def sent_all(self):
        self.mem.sent_all()

    def state(self):
        return self.mem.u.numpy().copy(), self.mem.v.numpy().copy()


class TFSubject:
    """hvd_dgc.tensorflow: local_gradient, then DGCMemory."""

    def __init__(self, momentum, nesterov, masking, numel=NUMEL):
        self.mem = TFMemory([numel], momentum, nesterov, masking)
        self.numel = numel

    def local_gradient(self, g, clip_norm, world):
        return tf_local_gradient(tf.constant(g), clip_norm, world)

    def accumulate(self, g):
        return self.mem.accumulate(0, g).numpy().copy(), None

    def sent(self, indices):
        self.mem.sent(0, tf.constant(indices, tf.int32))

    def sent_all(self):
        self.mem.sent_all(0)

    def state(self):
        u = self.mem.u[0].numpy() if self.mem.u else np.zeros(self.numel, np.float32)
        return u.copy(), self.mem.v[0].numpy().copy()


def make_subject(subject, momentum, nesterov, masking):
    if subject == "tf":
        return TFSubject(momentum, nesterov, masking)
    return TorchSubject(momentum, nesterov, masking, fused=subject == "torch_fused")


@pytest.mark.parametrize("world", [1, 4])
@pytest.mark.parametrize("clip_norm", [None, CLIP])
@pytest.mark.parametrize("masking", [True, False])
@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("subject", ["torch", "torch_fused", "tf"])
def test_memory_parity_every_step(subject, momentum, nesterov, masking, clip_norm, world):
    """Selection is the reference's top-k (selection is not compared here); each framework
    gets its own local_gradient of the same raw gradient, then accumulate, then sent."""
    grads = parity_grads()
    k = ref.num_selected(NUMEL, DENSITY)
    records = ref.run(grads, k, momentum, nesterov, masking, clip_norm, world)
    fw = make_subject(subject, momentum, nesterov, masking)
    exact = exact_for(subject, momentum, nesterov, clip_norm)
    check = np.testing.assert_array_equal if exact else assert_close
    clipped = 0
    for i, (g, rec) in enumerate(zip(grads, records)):
        at = f"{subject} step {i}"
        expected_g = ref.local_gradient(g, clip_norm, world)
        clipped += clip_norm is not None and ref.clip_scale(g, clip_norm, world) < 1
        fg = fw.local_gradient(g, clip_norm, world)
        # no clipping: a reshape and a cast, exact everywhere
        (check if clip_norm is not None else np.testing.assert_array_equal)(
            fg.numpy(), expected_g, err_msg=f"{at}: local gradient")
        v, block_max = fw.accumulate(fg)
        check(v[rec.indices], rec.values, err_msg=f"{at}: values sent")
        if block_max is not None:  # the fused kernel's block maxima of |v| (max is exact)
            whole = v[:NUMEL // 32 * 32].reshape(-1, 32)
            np.testing.assert_array_equal(block_max, np.abs(whole).max(axis=1))
        fw.sent(rec.indices)
        u, v = fw.state()
        check(u, rec.u, err_msg=f"{at}: u")
        check(v, rec.v, err_msg=f"{at}: v")
    if clip_norm is not None:  # the inputs clip some steps and not others, as intended
        assert 0 < clipped < STEPS


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("subject", ["reference", "torch", "torch_fused", "tf"])
def test_dense_path_at_density_one_is_momentum_sgd(subject, nesterov):
    """sent_all keeps u: what each step sends is torch.optim.SGD's momentum step
    (buf = m buf + g; Nesterov: g + m buf, which the memory forms as u + g, u = m buf)."""
    m, grads = 0.9, parity_grads(seed=2)[:5]
    p = torch.nn.Parameter(torch.zeros(NUMEL))
    sgd = torch.optim.SGD([p], lr=1.0, momentum=m, nesterov=nesterov)
    fw = None if subject == "reference" else make_subject(subject, m, nesterov, True)
    u, v = np.zeros(NUMEL, np.float32), np.zeros(NUMEL, np.float32)
    for g in grads:
        p.grad = torch.tensor(g)
        sgd.step()
        buf = sgd.state[p]["momentum_buffer"]
        expected = (p.grad + m * buf if nesterov else buf).numpy()
        if fw is None:
            u, v = ref.accumulate(u, v, g, m, nesterov)
            sent = v.copy()
            u, v = ref.sent_all(u, v)
        else:
            sent, _ = fw.accumulate(fw.local_gradient(g, None, 1))
            fw.sent_all()
            u, v = fw.state()
        # Plain momentum: SGD computes buf = (m * buf) + g as the reference does, so exact
        # but for eager PyTorch's fused multiply-add. Nesterov: g + m * buf against
        # (m * (u + g)) + g: equal as real numbers, not in float32.
        if not nesterov and subject in ("reference", "torch_fused", "tf"):
            np.testing.assert_array_equal(sent, expected)
        else:
            assert_close(sent, expected)
        np.testing.assert_array_equal(v, np.zeros(NUMEL))  # everything left
        assert_close(u, (m * buf if nesterov else buf).numpy())  # u kept: SGD's buffer


def test_delayed_averaging_update_equals_direct_simulation():
    """Weights after step i with update_i = own_i - own_(i-D) + avg_(i-D) [DGA] equal, on
    every rank, the weights a direct simulation gives: each step's average once it is D
    steps old, and the rank's own contribution for the last D steps, which are in flight;
    after a flush every rank holds synchronous SGD's weights."""
    ranks, steps, delay, lr = 3, 9, 2, 0.1
    rng = np.random.RandomState(5)
    own = rng.randn(ranks, steps, 6).astype(np.float32)
    avg = [ref.average(own[:, i]) for i in range(steps)]
    for r in range(ranks):
        w = np.zeros(6, np.float32)
        for i in range(steps):
            w = w - np.float32(lr) * ref.dga_update(own[r], avg, i, delay)
            arrived = sum((avg[j] for j in range(i + 1 - delay)), np.zeros(6))
            in_flight = sum((own[r, j] for j in range(max(0, i + 1 - delay), i + 1)),
                            np.zeros(6))
            assert_close(w, -lr * (arrived + in_flight), err_msg=f"rank {r} step {i}")
        for j in range(steps - delay, steps):  # flush: the last D averages arrive
            w = w - np.float32(lr) * (avg[j] - own[r, j])
        assert_close(w, -lr * np.sum(avg, axis=0))


# -- skip_nonfinite ----------------------------------------------------------------------
def test_nonfinite_reference_semantics_on_two_ranks():
    k, g = 1, np.float32(G)
    bad = np.float32([0.5, np.nan, 0.1, 1.0])
    start = [ref.Memory(np.float32([0.1, 0, 0, 0.2]), np.float32([0.3, 0, 0, -0.4]))] * 2
    # delay 0: one rank's NaN skips the step on both: memories as they were, nothing sent
    res = ref.nonfinite_sync_step(start, [g, bad], k, momentum=0.9, delay=0)
    assert res.skipped and res.owns is None
    for before, after in zip(start, res.memories):
        np.testing.assert_array_equal(after.u, before.u)
        np.testing.assert_array_equal(after.v, before.v)
    # delay 2: rank 0 steps as usual; rank 1 keeps its memory and sends zeros
    res = ref.nonfinite_sync_step(start, [g, bad], k, momentum=0.9, delay=2)
    normal = ref.step(start[0].u, start[0].v, g, k, momentum=0.9)
    assert not res.skipped
    np.testing.assert_array_equal(res.memories[0].v, normal.v)
    np.testing.assert_array_equal(res.owns[0], ref.scatter(normal.indices, normal.values, 4))
    np.testing.assert_array_equal(res.memories[1].u, start[1].u)
    np.testing.assert_array_equal(res.memories[1].v, start[1].v)
    np.testing.assert_array_equal(res.owns[1], np.zeros(4))


def guard_reference(delay):
    """tests/core/reference_guard.py's run on one rank (avg == own): per step the
    memory, the update (None: skipped) and the step counter."""
    k = ref.num_selected(guard.NUMEL, guard.DENSITY)
    zeros = np.zeros(guard.NUMEL, np.float32)
    mem, owns, out = [ref.Memory(zeros, zeros)], [], []
    for g in guard.grads():
        res = ref.nonfinite_sync_step(mem, [g], k, momentum=guard.MOMENTUM,
                                     masking=True, delay=delay)
        mem, update = res.memories, None
        if not res.skipped:
            owns.append(res.owns[0])
            update = ref.dga_update(owns, owns, len(owns) - 1, delay)
        out.append((mem[0], update, len(owns)))
    return out


def run_guard(framework):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "out.pkl")
        proc = subprocess.run([sys.executable, "-m", "tests.core.reference_guard",
                               framework, path], cwd=REPO, env=worker_env(),
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        with open(path, "rb") as f:
            return pickle.load(f)


@pytest.fixture(scope="module")
def torch_guard():
    return run_guard("torch")


@pytest.fixture(scope="module")
def tf_guard():
    return run_guard("tf")


def check_guard(runs, delay, skipped_update):
    """One framework's world-1 run (tests/core/reference_guard.py) against the reference.
    ``skipped_update``: what a skipped step returns (PyTorch leaves the weights, so 0;
    TensorFlow's tape returns NaN for the caller to check)."""
    steps, expected = runs[delay], guard_reference(delay)
    for i, (got, (mem, update, counter)) in enumerate(zip(steps, expected)):
        at = f"delay={delay} step {i}"
        if i == guard.BAD_STEP:  # the NaN: the memory must be bit-for-bit as it was
            before = steps[i - 1]
            np.testing.assert_array_equal(got["u"], before["u"], err_msg=f"{at}: u changed")
            np.testing.assert_array_equal(got["v"], before["v"], err_msg=f"{at}: v changed")
        assert_close(got["u"], mem.u, err_msg=f"{at}: u")
        assert_close(got["v"], mem.v, err_msg=f"{at}: v")
        assert got["step"] == counter, at
        if update is None:
            np.testing.assert_array_equal(got["update"], skipped_update(guard.NUMEL), at)
        else:  # with delay, the NaN step's own is 0, so is its update on one rank
            assert_close(got["update"], update, err_msg=f"{at}: update")


@pytest.mark.parametrize("delay", guard.DELAYS)
def test_torch_nonfinite_gradient_matches_reference(torch_guard, delay):
    check_guard(torch_guard, delay, lambda n: np.zeros(n, np.float32))


@pytest.mark.parametrize("delay", guard.DELAYS)
def test_tf_nonfinite_gradient_matches_reference(tf_guard, delay):
    check_guard(tf_guard, delay, lambda n: np.full(n, np.nan, np.float32))
