"""DGC's selection rule, one reference for both frameworks (tests/reference.py
``dgc_adapt``): from the same first threshold, PyTorch's and TensorFlow's
``DGCCompressor.adapt`` choose the same coordinates as the NumPy reference, in each
branch of the rule (in the window, too many, too few then lowered, exact fallback).
Before issue 18 TensorFlow sent up to 1.3 k records and never lowered a threshold."""

import numpy as np
import pytest
import tensorflow as tf
import torch

from hvd_dgc.tensorflow.compression import Compression as TFCompression
from hvd_dgc.torch.compression import Compression as TorchCompression
from tests.reference import dgc_adapt

N, K = 20_000, 200


def _flat(seed):
    return np.random.RandomState(seed).randn(N).astype(np.float32)


def _kth(flat, j):
    return np.sort(np.abs(flat))[-j]  # the j-th largest magnitude


# first threshold (as a function of the data) -> the branch of the rule it exercises
CASES = {
    "in_window": lambda f: _kth(f, 190),        # 190 pass: 0.8 k <= 190 <= k, kept as is
    "too_many": lambda f: _kth(f, 260),         # 260 pass (the 1.3 k aim): trimmed to k
    # few pass (the 180th largest / 0.8), one lowering by 0.8 brings ~180: in the window
    "too_few": lambda f: np.float32(_kth(f, 180)) / np.float32(0.8),
    "too_few_thrice": lambda f: np.float32(_kth(f, 180)) / np.float32(0.8) ** 3,
    "fallback": lambda f: np.float32(1e6),      # nothing passes after 10 rounds: exact top-k
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("seed", [0, 1])
def test_both_frameworks_choose_what_the_reference_chooses(case, seed):
    flat = _flat(seed)
    threshold = np.float32(CASES[case](flat))
    expected = dgc_adapt(flat, K, threshold)
    in_torch = TorchCompression.dgc.adapt(torch.from_numpy(flat), K,
                                          torch.tensor(threshold)).numpy()
    in_tf = TFCompression.dgc.adapt(tf.abs(tf.constant(flat)), tf.constant(K),
                                    tf.constant(threshold)).numpy()
    np.testing.assert_array_equal(np.sort(in_torch), expected)
    np.testing.assert_array_equal(np.sort(in_tf), expected)
    assert 0.8 * K <= expected.size <= K
    if case in ("too_many", "fallback"):
        assert expected.size == K  # an exact top-k
        np.testing.assert_array_equal(expected, np.sort(np.argsort(-np.abs(flat))[:K]))
    if case.startswith("too_few"):
        assert (np.abs(flat) >= threshold).sum() < 0.8 * K  # too few at first
        assert 160 <= expected.size < K  # lowered into the window, kept as is


@pytest.mark.parametrize("n,density", [(100_000, 0.001), (50_000, 0.01)])
def test_sampled_selection_sends_at_most_k_in_both_frameworks(n, density):
    k = int(np.ceil(n * density))
    for seed in range(3):
        flat = np.random.RandomState(seed).randn(n).astype(np.float32)
        torch_idx = TorchCompression.dgc.select(torch.from_numpy(flat), k).numpy()
        tf_idx = TFCompression.dgc.select(tf.constant(flat), tf.constant(k),
                                          tf.constant([seed, 0])).numpy()
        for idx in (torch_idx, tf_idx):
            assert 0.8 * k <= idx.size <= k and np.unique(idx).size == idx.size
            # a top set: nothing left behind is larger than what was chosen
            chosen = np.zeros(n, bool)
            chosen[idx] = True
            assert np.abs(flat[chosen]).min() >= np.abs(flat[~chosen]).max()


def test_reference_rule_by_hand():
    # |v| = 5, 4, 3, 2, 1, 0.5; k = 3, so the window's low end is 0.8 * 3 = 2.4 records
    v = np.array([5, -4, 3, 2, 1, 0.5], np.float32)
    # t = 4.5 passes 1 (< 2.4): t = 3.6 passes 2 (< 2.4): t = 2.88 passes 3: kept
    np.testing.assert_array_equal(dgc_adapt(v, 3, 4.5), [0, 1, 2])
    # t = 1.5 passes 4 (> k): the exact top-3 of those four
    np.testing.assert_array_equal(dgc_adapt(v, 3, 1.5), [0, 1, 2])
    # window low end 0.5 * 3 = 1.5: t = 3.6's 2 records are enough (fewer than k)
    np.testing.assert_array_equal(dgc_adapt(v, 3, 4.5, window=(0.5, 1.3)), [0, 1])
    # one round only: 4.5 (1 record), 3.6 (2 records), then the exact top-3
    np.testing.assert_array_equal(dgc_adapt(v, 3, 4.5, window=(0.9, 1.3), rounds=1),
                                  [0, 1, 2])
    # nothing passes 100 * 0.8^10 = 10.7: the exact top-3
    np.testing.assert_array_equal(dgc_adapt(v, 3, 100.0), [0, 1, 2])
    # and the frameworks agree on the short window
    in_torch = TorchCompression.dgc(window=(0.5, 1.3)).adapt(torch.from_numpy(v), 3,
                                                             torch.tensor(4.5))
    in_tf = TFCompression.dgc(window=(0.5, 1.3)).adapt(tf.abs(tf.constant(v)),
                                                       tf.constant(3), tf.constant(4.5))
    assert sorted(in_torch.tolist()) == sorted(in_tf.numpy().tolist()) == [0, 1]


def _launch_block(numels, seed=0):
    """A launch's flat memory: several tensors' v in one buffer (aligned, zeros between),
    with its block maxima."""
    from hvd_dgc.torch.memory import FlatMemory, Run
    gen = torch.Generator().manual_seed(seed)
    mem = FlatMemory()
    block = mem.block(tuple(range(len(numels))), numels, len(numels))
    g = torch.zeros(block.total)
    for i, n in enumerate(numels):
        lo, hi = block.span(i)
        g[lo:hi] = torch.randn(n, generator=gen) * (i + 1)
    mem.accumulate(block, g, [Run(0, block.total, 0.9, False)], with_block_max=True)
    return block


NUMELS = (5000, 70000, 1024, 300000, 33)


def _kernel_and_torch(monkeypatch, call):
    """``call()`` through the kernel library (where built: asserted), then in torch
    operations."""
    import hvd_dgc.torch.cpu_select as cpu_select
    from hvd_dgc.torch.memory import fused_kernel_available
    assert fused_kernel_available()
    kernel = call()
    with monkeypatch.context() as patch:
        patch.setattr(cpu_select, "_fused", lambda *tensors: False)
        return kernel, call()


@pytest.mark.parametrize("how", ["kernel", "torch"])
@pytest.mark.parametrize("density", [0.001, 0.01, 0.25])
def test_a_launch_selection_is_the_reference_rule_for_each_tensor(density, how, monkeypatch):
    """cpu_select.adapt_block, every tensor of a launch at once, chooses for each tensor
    what the NumPy reference chooses from the same first threshold: in the kernel
    library (every round of every tensor in one call) and in torch operations (a call a
    round), in each branch of the rule, a tensor whose k covers it among them."""
    import hvd_dgc.torch.cpu_select as cpu_select
    from hvd_dgc.torch.memory import fused_kernel_available
    assert fused_kernel_available()
    if how == "torch":
        monkeypatch.setattr(cpu_select, "_fused", lambda *tensors: False)
    block = _launch_block(NUMELS)
    ks = tuple(int(np.ceil(n * density)) for n in NUMELS)
    ks = ks[:-1] + (NUMELS[-1],)  # the last: every coordinate
    # first thresholds in every branch of the rule: too many, in the window, too few
    # (lowered until in it), nothing passes in any round (the exact top-k)
    firsts = []
    for i, (n, k) in enumerate(zip(NUMELS, ks)):
        flat = block.slice_of(block.v, i).numpy()
        j = [int(1.3 * k) + 1, k, max(1, int(0.5 * k)), None][i % 4]
        firsts.append(np.sort(np.abs(flat))[-min(j, n)] if j else np.float32(1e30))
    positions, counts = cpu_select.adapt_block(block.v, block.block_max, block.offsets,
                                               NUMELS, ks, torch.tensor(firsts))
    for i, part in enumerate(positions.split(list(counts))):
        flat = block.slice_of(block.v, i).numpy()
        expected = dgc_adapt(flat, ks[i], np.float32(firsts[i])) if ks[i] < NUMELS[i] \
            else np.arange(NUMELS[i])
        np.testing.assert_array_equal(np.sort(part.numpy() - block.offsets[i]), expected,
                                      err_msg=f"tensor {i}")
    # the branches were reached: tensor 2's first threshold passes too few (lowered), no
    # round reaches tensor 3's (its exact top-k)
    v = [block.slice_of(block.v, i).abs() for i in (2, 3)]
    assert int((v[0] >= firsts[2]).sum()) < 0.8 * ks[2] <= counts[2]
    assert float(v[1].max()) < firsts[3] * 0.8 ** 10 and counts[3] == ks[3]


@pytest.mark.parametrize("density", [0.001, 0.01, 0.25])
def test_the_kernel_and_torch_choose_the_same_coordinates(density, monkeypatch):
    """The kernel library's thresholds and scan (where built) and the same in torch
    operations (elsewhere) pick the same records of a launch."""
    block = _launch_block(NUMELS, seed=3)
    ks = tuple(int(np.ceil(n * density)) for n in NUMELS)
    comp = TorchCompression.dgc()
    args = (block.v, block.block_max, block.offsets, NUMELS, ks, range(len(NUMELS)), 0, 7)
    kernel, eager = _kernel_and_torch(monkeypatch, lambda: comp.pick(*args))
    assert kernel.counts == eager.counts
    for a, b in zip(kernel.positions.split(list(kernel.counts)),
                    eager.positions.split(list(eager.counts))):
        assert torch.equal(torch.sort(a).values, torch.sort(b).values)
    for count, k in zip(kernel.counts, ks):
        assert 0.8 * k <= count <= k


@pytest.mark.parametrize("density", [0.001, 0.01, 0.25])
def test_the_kernel_and_torch_estimate_the_same_thresholds(density, monkeypatch):
    """The sampled thresholds, per tensor the k-th largest |v| of its sample: the kernel
    library's (a min-heap of the few largest at DGC's final density, a partial sort at
    the warm-up's) and one top-k over a matrix of samples in torch, bit for bit."""
    import hvd_dgc.torch.cpu_select as cpu_select
    block = _launch_block(NUMELS, seed=5)
    ks = tuple(int(np.ceil(n * density)) for n in NUMELS)
    layout = cpu_select.SampleLayout(block.offsets, NUMELS, 0.01, 64, "cpu")
    args = (block.v, ks, 1.3, tuple(range(len(NUMELS))), 0, 1, 7)
    kernel, eager = _kernel_and_torch(monkeypatch, lambda: layout.thresholds(*args))
    assert torch.equal(kernel, eager), (kernel, eager)
    assert bool((kernel > 0).all())
