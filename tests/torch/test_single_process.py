"""Single-process tests: tests/core/test_reference.py's vectors, schedule, cost model, packing, stats."""

import math
import re

import pytest
import torch

from hvd_dgc import CompressionStats, CostModel, DensitySchedule
from hvd_dgc.paths import PathKind

DENSE, SPARSE = PathKind.DENSE, PathKind.ALLGATHER
from hvd_dgc.schedule import ADAPTIVE_SENDS, DEFAULT_SENDS, as_schedule, num_selected
from hvd_dgc.torch.compression import Compression, DGCCompressor, coalesce_sorted
from hvd_dgc.torch.gpu_select import select_many
from hvd_dgc.torch.memory import local_gradient
from tests.flatmem import OneTensor

G = [0.5, -2.0, 0.1, 1.0]


def trace(masking, nesterov, steps=3):
    mem, sent = OneTensor(4, masking, 0.9, nesterov), []
    for _ in range(steps):
        v = mem.accumulate(torch.tensor(G))
        idx = Compression.topk.select(v, 1)
        sent.append((int(idx), round(float(v[idx]), 5)))
        mem.sent(idx)
    return sent, {"u": mem.u, "v": mem.v}


def test_memory_trace_with_masking():
    sent, buf = trace(masking=True, nesterov=False)
    assert sent == [(1, -2.0), (3, 2.9), (1, -5.8)]
    assert torch.allclose(buf["u"], torch.tensor([1.355, 0, 0.271, 1.0]))
    assert torch.allclose(buf["v"], torch.tensor([2.805, 0, 0.561, 1.0]))


def test_memory_trace_without_masking():
    sent, _ = trace(masking=False, nesterov=False)
    assert sent == [(1, -2.0), (1, -3.8), (3, 5.61)]


def test_memory_trace_nesterov_with_masking():
    sent, _ = trace(masking=True, nesterov=True)
    assert sent == [(1, -3.8), (3, 4.61), (1, -9.22)]


def test_error_feedback_without_momentum_keeps_every_unsent_value():
    mem = OneTensor(4)
    total_sent = torch.zeros(4)
    for _ in range(5):
        v = mem.accumulate(torch.tensor(G))
        idx = Compression.topk.select(v, 1)
        total_sent[idx] += v[idx]
        mem.sent(idx)
    # sent + residual == everything ever fed in: nothing lost
    assert torch.allclose(total_sent + mem.v, 5 * torch.tensor(G))


def test_dense_path_keeps_momentum_so_density_one_is_momentum_sgd():
    mem, buf = OneTensor(4, momentum=0.9), torch.zeros(4)
    for step in range(4):
        g = torch.tensor(G) * (step + 1)
        v = mem.accumulate(g)
        sent = v.clone()
        mem.sent_all()
        buf = 0.9 * buf + g  # torch.optim.SGD's momentum buffer
        assert torch.allclose(sent, buf)


def test_decompress_average_of_two_workers():
    for comp in (Compression.dgc, Compression.dgc(fp16_values=True)):
        w0 = comp.pack(torch.tensor([-2.0]), torch.tensor([1]))
        w1 = comp.pack(torch.tensor([-1.0, 0.5]), torch.tensor([1, 3]))
        avg = comp.scatter_sum(torch.cat([w0, w1]), 4) / 2
        assert avg.tolist() == [0.0, -1.5, 0.0, 0.25]
        assert w1.shape == (2, comp.record_bytes) and w1.dtype == torch.uint8


def test_pack_unpack_roundtrip_and_record_size():
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(100, generator=gen)
    indices = torch.randperm(10 ** 6, generator=gen)[:100]
    for fp16, size in ((False, 8), (True, 6)):
        comp = Compression.dgc(fp16_values=fp16)
        packed = comp.pack(values, indices)
        assert packed.numel() == 100 * size
        v, i = comp.unpack(packed)
        assert torch.equal(i.long(), indices)
        # fp16 rounds to half an ulp: 2^-11 relative (2^-25 absolute below its normals)
        assert torch.allclose(v.float(), values, rtol=2 ** -11 if fp16 else 0,
                              atol=2 ** -25 if fp16 else 0)


@pytest.mark.parametrize("n,density", [(10 ** 5, 0.001), (10 ** 6, 0.001), (50_000, 0.01),
                                       (4096, 0.25)])
def test_sampled_threshold_within_window(n, density):
    comp = DGCCompressor()
    k = num_selected(n, density)
    for seed in range(3):
        x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
        idx = comp.select(x, k)
        assert 0.8 * k <= idx.numel() <= k  # never more bytes than an exact top-k
        assert idx.unique().numel() == idx.numel()
        # what is chosen is a true top set: nothing left behind is larger
        chosen = torch.zeros(n, dtype=torch.bool)
        chosen[idx] = True
        assert x.abs()[chosen].min() >= x.abs()[~chosen].max()


def test_sampled_threshold_on_tiny_tensors_with_a_tiny_sample():
    for n in (5, 40, 130, 1000):
        x = torch.randn(n, generator=torch.Generator().manual_seed(n))
        k = max(1, n // 10)
        idx = DGCCompressor(min_sample=1, sample_ratio=0.001).select(x, k)
        assert 0.8 * k <= idx.numel() <= k
        assert set(idx.tolist()) <= set(torch.topk(x.abs(), int(1.3 * k) + 1).indices.tolist())


def test_sampled_threshold_falls_back_when_sample_misleads():
    # all mass in a few spikes the sample almost surely misses
    x = torch.zeros(200_000)
    x[torch.arange(0, 200_000, 1000)] = torch.arange(1, 201, dtype=torch.float32)
    idx = DGCCompressor(sample_ratio=0.001, min_sample=10).select(x, 200)
    assert 160 <= idx.numel() <= 200
    assert set(idx.tolist()) >= set(range(0, 200_000, 1000)[40:])


def _gpu_form(comp, flats, ks, seed=0):
    """The accelerator's selection (gpu_select.select_many), run here on CPU tensors."""
    draws = torch.rand(len(flats), generator=torch.Generator().manual_seed(seed)).tolist()
    return select_many(flats, ks, draws, comp.sample_ratio, comp.min_sample)


def _check_gpu_form(flats, ks, sel):
    """Exactly k records per tensor; the real ones distinct, equal to v there, all among the
    tensor's exact top k; padding repeats a sent index with value 0. Returns the count of
    real records per tensor."""
    assert sel.ks == tuple(ks) and sel.indices.shape == sel.values.shape == (sum(ks),)
    reals = []
    for x, k, (idx, val) in zip(flats, ks, sel.split()):
        real = val != 0
        sent = idx[real]
        assert sent.unique().numel() == sent.numel()
        assert torch.equal(val[real], x[sent])
        assert set(sent.tolist()) <= set(torch.topk(x.abs(), k).indices.tolist())
        assert set(idx[~real].tolist()) <= set(sent.tolist()) or not real.any()
        reals.append(sent.numel())
    return reals


@pytest.mark.parametrize("n,density", [(3000, 0.001), (100_000, 0.001), (100_000, 0.01),
                                       (2_359_296, 0.001), (4096, 0.25)])
def test_gpu_form_sends_exactly_k_records_of_the_top_k(n, density):
    """One tensor at a time; the records sum back to exactly what was sent."""
    comp = DGCCompressor()
    k = num_selected(n, density)
    real_total = 0
    for seed in range(3):
        x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
        sel = _gpu_form(comp, [x], [k], seed)
        real_total += _check_gpu_form([x], [k], sel)[0]
        back = comp.scatter_sum(comp.pack(sel.values, sel.indices), n)
        expect = torch.zeros(n)
        expect[sel.indices] = sel.values
        assert torch.equal(back, expect)
    assert real_total >= 0.99 * 3 * k  # aimed at 2k passing: k are found nearly always


def test_gpu_form_selects_many_tensors_at_once_as_each_alone():
    """A ResNet-like group (sizes from 1k to 2.4M, one all-zero, one with few non-zeros, one
    with k >= n) in one call: each tensor gets its own top k, as if selected alone, and the
    group's records sum back into each tensor's update (scatter_sum_many)."""
    gen = torch.Generator().manual_seed(5)
    sizes = [1024, 2_359_296, 4608, 65_536, 300, 50_000, 20_000, 2048]
    flats = [torch.randn(n, generator=gen) for n in sizes]
    flats[3] = torch.zeros(sizes[3])  # nothing to send: padding only, value 0
    flats[5] = flats[5] * (torch.rand(sizes[5], generator=gen) < 0.0005)  # ~25 non-zeros
    ks = [num_selected(n, 0.001) for n in sizes]
    ks[4] = 300  # k = n: every non-zero goes
    comp = DGCCompressor()
    sel = _gpu_form(comp, flats, ks)
    reals = _check_gpu_form(flats, ks, sel)
    assert reals[3] == 0 and reals[4] == 300
    assert reals[5] == int((flats[5] != 0).sum())  # fewer non-zeros than k: all of them
    for i in (0, 1, 2, 6, 7):
        assert reals[i] >= 0.8 * ks[i], (i, reals[i], ks[i])
    # two ranks' records of the whole group, summed per tensor in one scatter
    other = _gpu_form(comp, [f.flip(0) for f in flats], ks, seed=1)
    records = torch.cat([comp.pack(sel.values, sel.indices),
                         comp.pack(other.values, other.indices)])
    sums = comp.scatter_sum_many(records, tuple(sizes), tuple(ks), scale=0.5)
    for n, mine, theirs, total in zip(sizes, sel.split(), other.split(), sums):
        expect = torch.zeros(n)
        expect.index_put_((mine[0],), mine[1] * 0.5, accumulate=True)
        expect.index_put_((theirs[0],), theirs[1] * 0.5, accumulate=True)
        assert torch.equal(total, expect)


def test_gpu_form_reads_the_memorys_aligned_buffer_in_place():
    """Tensors lying one after another in one buffer at whole blocks (the memory's
    layout) are selected from that buffer itself, not a padded copy: the same records as
    from separate tensors. Whatever lies between them is never sent, not even where it
    is larger than anything in them."""
    from hvd_dgc.torch.gpu_select import _joined, _plan
    from hvd_dgc.torch.memory import BLOCK, aligned_size
    gen = torch.Generator().manual_seed(6)
    sizes = (3000, 70_000, 1024, 20_001)
    ks = tuple(num_selected(n, 0.01) for n in sizes)
    offsets = [0]
    for n in sizes:
        offsets.append(offsets[-1] + aligned_size(n))
    for gaps in (0.0, 100.0):
        buffer = torch.full((offsets[-1] + BLOCK,), gaps)  # (more after the last: a launch's dense tensors)
        flats = [buffer[o:o + n] for o, n in zip(offsets, sizes)]
        for f in flats:
            f.copy_(torch.randn(f.numel(), generator=gen))
        plan = _plan(sizes, ks, "cpu", 0.001, 1000)
        assert _joined(plan, flats).data_ptr() == buffer.data_ptr()  # no copy
        assert _joined(plan, [f.clone() for f in flats]).data_ptr() != buffer.data_ptr()
        comp = DGCCompressor()
        in_place = _gpu_form(comp, flats, ks)
        copied = _gpu_form(comp, [f.clone() for f in flats], ks)
        if gaps == 0.0:
            assert torch.equal(in_place.indices, copied.indices)
            assert torch.equal(in_place.values, copied.values)
        reals = _check_gpu_form(flats, ks, in_place)  # (indices inside each tensor)
        assert all(r >= 0.8 * k for r, k in zip(reals, ks)), (reals, ks)


def test_gpu_form_sends_every_coordinate_where_k_covers_the_tensor():
    """Density 1 through the sparse path (forced, or a warm-up stage): every coordinate,
    zeros included, in its own slot, beside tensors selected as usual. The threshold
    aimed at 2k from a sample used to leave a few of the smallest out (7 of 16,384),
    which training on a GPU then applied a step late."""
    gen = torch.Generator().manual_seed(4)
    sizes, ks = (16384, 1000, 33), (16384, 5, 33)
    flats = [torch.randn(n, generator=gen) * (torch.rand(n, generator=gen) < 0.7)
             for n in sizes]
    for (indices, values), flat, k in zip(select_many(flats, ks, [0.3] * 3).split(),
                                          flats, ks):
        assert indices.numel() == k
        if k >= flat.numel():
            assert torch.equal(indices.sort().values, torch.arange(flat.numel()))
        assert torch.equal(values, flat[indices])


def test_gpu_form_with_few_non_zeros_and_spikes_the_sample_misses():
    comp = DGCCompressor(sample_ratio=0.001, min_sample=10)
    x = torch.zeros(200_000)
    x[torch.arange(0, 200_000, 1000)] = torch.arange(1, 201, dtype=torch.float32)
    sel = _gpu_form(comp, [x], [400])  # k above the 200 non-zeros: all of them go
    assert sel.indices.numel() == 400
    assert set(sel.indices[sel.values != 0].tolist()) == set(range(0, 200_000, 1000))
    sel = _gpu_form(comp, [x], [150])  # k below: the 150 largest
    assert set(sel.indices[sel.values != 0].tolist()) == set(range(50_000, 200_000, 1000))
    zeros = _gpu_form(comp, [torch.zeros(50_000)], [50])
    assert zeros.indices.numel() == 50 and not zeros.values.any()
    # the CPU form: distinct indices, no padding
    cpu = comp.sparsify(x, 150).indices
    assert cpu.unique().numel() == cpu.numel() <= 150


@pytest.mark.parametrize("shape,sparse_dim", [((50, 20), 1), ((7, 9, 4), 2), ((30,), 1)])
def test_rows_summed_in_record_order_as_a_gpu_coalesces_them(shape, sparse_dim):
    """A sparse gradient's repeated rows (an embedding looked up twice, every rank's rows
    gathered) are summed on a GPU by a stable sort and index_put_ (coalesce_sorted): the
    same rows as coalesce(), each sum taken in record order, bit for bit, whatever the
    device, so ranks holding the same records hold the same sums."""
    gen = torch.Generator().manual_seed(3)
    nnz = 300
    idx = torch.stack([torch.randint(0, shape[d], (nnz,), generator=gen)
                       for d in range(sparse_dim)])
    vals = torch.randn((nnz,) + shape[sparse_dim:], generator=gen)
    out = coalesce_sorted(torch.sparse_coo_tensor(idx, vals, shape))
    sums = {}
    for i in range(nnz):  # record order, one add at a time
        row = tuple(idx[:, i].tolist())
        sums[row] = sums[row] + vals[i] if row in sums else vals[i].clone()
    rows = sorted(sums)
    assert out.is_coalesced()
    assert [tuple(c) for c in out.indices().t().tolist()] == rows
    assert torch.equal(out.values(), torch.stack([sums[r] for r in rows]))


def test_compressor_options_and_errors():
    c = Compression.dgc(sample_ratio=0.05, fp16_values=True)
    assert c.sample_ratio == 0.05 and c.fp16_values and c.record_bytes == 6
    assert Compression.dgc.sample_ratio == 0.01  # the shared default is untouched
    assert c == Compression.dgc(sample_ratio=0.05, fp16_values=True) and hash(c) == hash(
        Compression.dgc(sample_ratio=0.05, fp16_values=True))
    with pytest.raises(TypeError, match="no option"):
        Compression.dgc(sample=0.1)
    with pytest.raises(ValueError, match="sample_ratio"):
        Compression.dgc(sample_ratio=0)
    with pytest.raises(ValueError, match="density must be in"):
        Compression.topk(density=2)


def test_standalone_compress_decompress():
    x = torch.randn(3, 1000)
    packed, ctx = Compression.topk(density=0.01).compress(x)
    dense = Compression.topk.decompress(packed, ctx)
    assert dense.shape == x.shape
    top = torch.topk(x.abs().view(-1), 30).indices
    assert torch.equal(dense.view(-1)[top], x.view(-1)[top])
    assert int((dense != 0).sum()) == 30


def test_local_gradient_clipping_scales_with_world_size():
    g, p = torch.full((4,), 10.0), torch.zeros(4)
    for world in (1, 4, 16):
        out = local_gradient(g, p, clip_norm=2.0, world_size=world)
        assert math.isclose(float(out.norm()), 2.0 / math.sqrt(world), rel_tol=1e-5)
    small = local_gradient(torch.full((4,), 1e-3), p, clip_norm=2.0, world_size=4)
    assert torch.equal(small, torch.full((4,), 1e-3))
    decayed = local_gradient(torch.zeros(2), torch.tensor([1.0, -2.0]), weight_decay=0.1)
    assert torch.allclose(decayed, torch.tensor([0.1, -0.2]))


def test_paper_warmup_schedule():
    s = DensitySchedule(0.001, warmup=4, unit="epoch")
    assert [s(0, e) for e in (0, 1, 2, 3, 4, 40)] == [0.25, 0.0625, 0.015625, 0.004, 0.001, 0.001]
    assert s(0, 0.99) == 0.25
    steps = DensitySchedule(0.001, warmup=400, unit="step")
    assert [steps(t, 0) for t in (0, 99, 100, 250, 399, 400)] == [
        0.25, 0.25, 0.0625, 0.015625, 0.004, 0.001]
    # a warm-up never goes below the final density
    assert DensitySchedule(0.01, warmup=4)(0, 3) == 0.01
    assert DensitySchedule(0.001)(0, 0) == 0.001


def test_schedule_inputs():
    fn = as_schedule(lambda step, epoch: 0.5 if step < 10 else 0.01)
    assert fn(0, 0) == 0.5 and fn(10, 0) == 0.01
    with pytest.raises(ValueError, match="returned by the schedule"):
        as_schedule(lambda step, epoch: 2.0)(0, 0)
    with pytest.raises(ValueError, match="warmup unit"):
        DensitySchedule(0.1, warmup=2, unit="hour")
    with pytest.raises(ValueError, match="warmup must be"):
        DensitySchedule(0.1, warmup=-1)


def test_cost_model_break_even_density():
    cm = CostModel(alpha=0.0)
    n = 10 ** 6
    # fp32 values + int32 indices: sparse wins below density 1/N
    for world in (2, 4, 8, 32):
        assert cm.choose(n, int(n / world * 0.95), world) == SPARSE
        assert cm.choose(n, int(n / world * 1.05), world) == DENSE
    # first warm-up stage (25%) on 32 workers: the allgather moves 8x the dense volume
    assert cm.sparse_seconds(n // 4, 32, 4, 4) / cm.dense_seconds(n, 32, 4) == pytest.approx(
        8 * 31 / 32 * 32 / 31, rel=1e-9)
    assert cm.choose(n, n // 4, 32) == DENSE
    assert cm.choose(n, n // 1000, 32) == SPARSE
    assert cm.choose(n, n, 1) == DENSE            # selecting everything is dense
    assert cm.choose(n, n // 1000, 1) == SPARSE   # np=1: same algorithm as np=2
    # fp16 dense halves dense cost; fp16 values shrink sparse records to 6 bytes
    assert cm.choose(n, int(0.6 * n / 2), 2, dense_value_bytes=2) == DENSE
    with pytest.raises(ValueError, match="bandwidth"):
        CostModel(bandwidth=0)


def test_stats():
    s = CompressionStats()
    s.record("a", SPARSE, 1000, 1, 8, 0.001)
    s.record("b", DENSE, 10, 10, 40, 0.001)
    s.end_step()
    out = s.summary()
    assert out["bytes_sent"] == 48 and out["dense_fp32_bytes"] == 4040
    assert out["compression_ratio"] == pytest.approx(4040 / 48)
    assert out["paths"] == {SPARSE: 1, DENSE: 1} and out["steps"] == 1
    assert out["last_step"]["tensors"]["a"]["sent"] == 1
    t = CompressionStats()
    t.load_state_dict(s.state_dict())
    assert t.summary()["bytes_sent"] == 48


def test_each_optimizer_owns_its_compressor_copy():
    a, b = Compression.dgc(), Compression.dgc()
    assert a == b and a is not b and a is not Compression.dgc
    a.generator("cpu").manual_seed(123)
    assert not torch.equal(a.generator("cpu").get_state(), b.generator("cpu").get_state())


# -- the fused C++ kernel (hvd_dgc/torch/csrc) against the eager maths ---------

def test_fused_kernel_is_built():
    # tools/install.sh builds it; a silent fallback would leave the benchmark's
    # "fused" row measuring eager code.
    from hvd_dgc.torch.memory import fused_kernel_available
    assert fused_kernel_available(), (
        "hvd_dgc/torch/_fused_memory is not built: run `python setup.py build_ext --inplace`")


@pytest.mark.parametrize("momentum,nesterov", [(0.9, False), (0.9, True), (0.0, False)])
@pytest.mark.parametrize("n", [4096, 1000 * 32 + 7])
@pytest.mark.parametrize("direct", [False, True])
def test_fused_memory_update_matches_eager(momentum, nesterov, n, direct):
    """The kernel (from a flat gradient, or read from the tensors with weight decay and
    a scale: ``direct``) against eager PyTorch, over a block of three tensors with the zeros
    between them; and the same block written beside the old one (a guarded step)."""
    from hvd_dgc.torch import memory as M
    gen = torch.Generator().manual_seed(n)
    numels = (n, 100, 33)
    decays = (0.0, 1e-2, 0.0)
    params = [torch.randn(k, generator=gen) for k in numels]
    # Adam's frozen preconditioner on the last two (exchange.py passes it as a scale)
    scales = (None, torch.rand(100, generator=gen) + 0.5, torch.rand(33, generator=gen))
    mems = {}
    for name in ("fused", "eager", "guarded"):
        mem = M.FlatMemory()
        mems[name] = (mem, mem.block((0, 1, 2), numels, 3))
    total = mems["fused"][1].total
    runs = [M.Run(0, total, momentum, nesterov)]
    for step in range(4):
        grads = [torch.randn(k, generator=gen) * (step + 1) for k in numels]
        g = torch.zeros(total)
        for o, gr, p, d, sc in zip(mems["fused"][1].offsets, grads, params, decays, scales):
            g[o:o + gr.numel()] = (gr + d * p) * (1.0 if sc is None else sc)
        mem, block = mems["fused"]
        if direct:
            v_f = mem.accumulate(block, g, runs, True,
                                 sources=(grads, params, decays, scales))
        else:
            v_f = mem.accumulate(block, g, runs, True)
        mem_e, block_e = mems["eager"]
        saved, M._fused_memory = M._fused_memory, None
        try:
            v_e = mem_e.accumulate(block_e, g, runs, True)
        finally:
            M._fused_memory = saved
        mem_g, block_g = mems["guarded"]
        mem_g.undo.snapshot(block_g)
        v_g = mem_g.accumulate(block_g, g, runs, True)
        mem_g.undo.commit()
        # a few ulps of the values (|v| ~ 10): torch's vector kernels may use FMA
        torch.testing.assert_close(v_f, v_e, rtol=1e-5, atol=1e-5)
        assert torch.equal(v_g, v_f) and (momentum == 0 or torch.equal(block_g.u, block.u))
        if momentum:
            torch.testing.assert_close(block.u, block_e.u, rtol=1e-5, atol=1e-5)
        assert torch.equal(block.block_max, M.block_abs_max(v_f))
        assert torch.equal(block.v[n:block.offsets[1]], torch.zeros(block.offsets[1] - n))
        idx = Compression.topk.select(v_f, 10)
        for m, b in mems.values():
            m.sent(b, idx, idx)


def test_a_skipped_step_leaves_the_memory_exactly_as_it_was():
    """snapshot + rollback: the step written beside the old buffers, which come back."""
    from hvd_dgc.torch import memory as M
    mem = M.FlatMemory()
    block = mem.block(("a", "b"), (70, 40), 2)
    runs = [M.Run(0, block.total, 0.9, False)]
    g = torch.randn(block.total)
    mem.accumulate(block, g, runs, True)
    before = (block.u.clone(), block.v.clone())
    mem.undo.snapshot(block)
    mem.accumulate(block, torch.full((block.total,), float("nan")), runs, True)
    mem.sent(block, torch.tensor([3, 5]), torch.tensor([3]))
    assert not bool(torch.isfinite(block.block_max).all())  # NaN shows in the maxima
    mem.undo.rollback()
    assert torch.equal(block.u, before[0]) and torch.equal(block.v, before[1])
    mem.undo.snapshot(block)  # and a kept step goes on from the old buffers
    mem.accumulate(block, g, runs)
    mem.undo.commit()
    torch.testing.assert_close(block.u, 0.9 * before[0] + g, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("momentum,nesterov", [(0.9, False), (0.9, True), (0.0, False)])
@pytest.mark.parametrize("guarded", [False, True])
@pytest.mark.parametrize("direct", [False, True])
def test_a_v_sent_whole_in_place_reads_as_zeros_bit_for_bit(momentum, nesterov, guarded,
                                                            direct):
    """The dense path leaves the v it sent in place uncleared (MemoryBlock.clear_later);
    the next update reads zeros for it. Against clearing it at once, step after step: the
    same bits of u, v and the block maxima, whether v went whole, in two parts or one
    part only (that part cleared at the update), with a guarded step rolled back and a
    reader (a checkpoint) between steps."""
    from hvd_dgc.torch import memory as M
    gen = torch.Generator().manual_seed(7)
    numels = (32 * 300 + 5, 77)
    mems = {}
    for name in ("lazy", "eager"):
        mem = M.FlatMemory()
        mems[name] = (mem, mem.block(("a", "b"), numels, 2))  # (aligned: block maxima)
    (lazy, lb), (eager, eb) = mems["lazy"], mems["eager"]
    total, cut = lb.total, lb.offsets[1]
    runs = [M.Run(0, total, momentum, nesterov)]
    # how v leaves at each step: whole, in two parts, one part only
    sendings = [[(0, total)], [(0, cut), (cut, total)], [(cut, total)], [(0, total)],
                [(0, total)], [(0, cut), (cut, total)], [(0, total)]]
    read_zeros = 0
    for step, parts in enumerate(sendings):
        grads = [torch.randn(k, generator=gen) for k in numels]
        g = torch.zeros(total)
        for o, gr in zip(lb.offsets, grads):
            g[o:o + gr.numel()] = gr
        sources = (grads, [torch.zeros(k) for k in numels], (0.0, 0.0), (None, None))
        if lb.stale_whole(lb.stale):  # the last v, not cleared: this update reads zeros
            read_zeros += bool(lb.v.abs().sum() > 0)
        undo = guarded and step == 3
        for mem, block in mems.values():
            if guarded:
                mem.undo.snapshot(block)
            mem.accumulate(block, g, runs, True, sources=sources if direct else None)
        assert torch.equal(lb.v, eb.v) and torch.equal(lb.block_max, eb.block_max), step
        assert momentum == 0 or torch.equal(lb.u, eb.u)
        for mem, block in mems.values():
            if undo:
                mem.sent(block, torch.tensor([1, 2]), torch.tensor([1]))
                mem.undo.rollback()
            elif guarded:
                mem.undo.commit()
        if undo:  # back to the v of step 2, its part that went cleared by the update
            assert not lb.stale and torch.equal(lazy.residual("b"), torch.zeros(77))
            assert torch.equal(lazy.residual("a"), eager.residual("a"))
            continue
        for lo, hi in parts:
            lb.clear_later(lb.v[lo:hi], lo, hi)
            eb.v[lo:hi].zero_()
        if step == 5:  # a checkpoint between steps: what it reads is zero where v went
            assert torch.equal(lazy.state_dict()["a"]["v"], torch.zeros(numels[0]))
            assert not lb.stale  # (settled: cleared there and then)
    # the updates of steps 1, 2, 4 (none after a rollback), 5 read zeros for a stale v
    assert read_zeros == (3 if guarded else 4)


def test_the_memory_knows_which_tensors_have_nothing_pending():
    """``MemoryBlock.zero``: the tensors whose residual reads zero, which may leave as
    stock Horovod sends them (paths.py InPlacePath). A fresh block's are; an update
    writes them all; a dense send marks the tensors it covers whole; a skipped step
    puts back what was; what an aggregation gives back, a tensor moved in with its
    residual, or a residual handed out (a view: it may be written) is pending."""
    from hvd_dgc.torch import memory as M
    mem = M.FlatMemory()
    block = mem.block(("a", "b", "c"), (40, 30, 20))
    assert block.zero == {0, 1, 2}
    runs = [M.Run(0, block.total, 0.0, False)]
    mem.accumulate(block, torch.randn(block.total), runs)
    assert block.zero == set()
    block.clear_later(block.v[0:70], 0, 70)  # a and b sent whole, c kept
    assert block.zero == {0, 1}
    M.FlatMemory.sent_range(block, 70, 90)
    assert block.zero == {0, 1, 2}
    mem.undo.snapshot(block)
    mem.accumulate(block, torch.randn(block.total), runs)
    mem.undo.rollback()
    assert block.zero == {0, 1, 2}
    M.FlatMemory.give_back(block, torch.tensor([3]), torch.tensor([0.5]))
    assert block.zero == set()
    block.clear_later(block.v[0:block.total], 0, block.total)
    mem.residual("b")
    assert block.zero == {0, 2}
    moved = mem.block(("c", "b"), (20, 30))
    assert moved.zero == set() and mem.block(("d",), (5,)).zero == {0}


def test_finite_flag_is_nan_exactly_where_a_value_is_not_finite():
    """The guard's look at averages written in place (update.py InPlaceUpdate): 0 or
    NaN, never a false alarm from a sum that overflows."""
    import hvd_dgc.torch.memory  # noqa: F401  (loads the kernel library)
    big = [torch.full((1000,), 3e38), torch.full((77,), -3e38), torch.zeros(5)]
    assert float(torch.ops.hvd_dgc.finite_flag(big)) == 0.0
    assert not torch.isfinite(sum(t.sum() for t in big))  # where a plain sum overflows
    for bad in (float("inf"), float("-inf"), float("nan")):
        tensors = [t.clone() for t in big]
        tensors[1][13] = bad
        assert torch.isnan(torch.ops.hvd_dgc.finite_flag(tensors))


def test_blocks_move_tensors_between_them_and_checkpoints_stay_per_tensor():
    """A tensor's u and v follow it into a new block (its launch's layout changed), and
    the checkpoint format is one entry per tensor whatever the blocks."""
    from hvd_dgc.torch import memory as M
    mem = M.FlatMemory()
    first = mem.block(("a", "b"), (50, 30), 2)
    mem.accumulate(first, torch.randn(first.total), [M.Run(0, first.total, 0.5, False)])
    a, b = mem.residual("a").clone(), mem.residual("b").clone()
    second = mem.block(("b", "c", "a"), (30, 10, 50), 1)
    assert torch.equal(mem.residual("a"), a) and torch.equal(mem.residual("b"), b)
    assert mem.residual("c").abs().sum() == 0 and ("a", "b") not in [k for k, _ in mem.blocks]
    state = mem.state_dict()
    assert set(state) == {"a", "b", "c"} and torch.equal(state["a"]["v"], a)
    fresh = M.FlatMemory()
    fresh.load_state_dict(state)
    placed = fresh.block(("a",), (50,), 1)
    assert torch.equal(fresh.residual("a"), a) and placed.total == 64
    assert second.total == 32 + 10 + 50


def _scan_once(v, block_max, offsets, numels, thresholds, ks):
    """One round of the kernel's scan (a window whose low end is 0 takes whatever the
    first threshold finds): (positions, counts)."""
    found, counts, short = torch.ops.hvd_dgc.scan(v, block_max, offsets, numels,
                                                  thresholds, ks, 0.0, 1.0, 0)
    assert not bool(short.any())
    return found, counts


@pytest.mark.parametrize("n", [32 * 500, 32 * 500 + 19])
def test_kernel_scan_finds_exactly_the_coordinates_at_or_above_threshold(n):
    from hvd_dgc.torch.memory import block_abs_max
    x = torch.randn(n, generator=torch.Generator().manual_seed(1))
    padded = torch.zeros(-(-n // 32) * 32)
    padded[:n] = x
    for threshold in (2.5, 3.0, 10.0):
        expected = torch.nonzero(x.abs() >= threshold).view(-1)
        got, counts = _scan_once(
            padded, block_abs_max(padded), torch.tensor([0]), torch.tensor([n]),
            torch.tensor([threshold]), torch.tensor([n]))
        assert torch.equal(got, expected) and counts.tolist() == [expected.numel()]
        top, counts = _scan_once(  # more than k: the k largest of them
            padded, block_abs_max(padded), torch.tensor([0]), torch.tensor([n]),
            torch.tensor([threshold]), torch.tensor([3]))
        exact = torch.topk(x.abs(), min(3, expected.numel())).indices
        assert torch.equal(top, torch.sort(exact).values) and counts.tolist() == [top.numel()]


def test_kernel_scan_keeps_the_k_largest_of_many_with_ties_first_in_position():
    """The radix select behind the scan's "too many" case (a warm-up density: millions of
    candidates): per segment, exactly the k largest, in position order; of values equal
    to the k-th largest, the first ones; k=0 keeps none."""
    from hvd_dgc.torch.memory import block_abs_max
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(32 * 3000, generator=gen)
    x[:32 * 1000] = torch.randint(-4, 5, (32 * 1000,), generator=gen).float()  # ties
    x[32 * 1000:32 * 2000] *= 1e-30  # magnitudes in the lowest bits' buckets
    offsets, numels = torch.tensor([0, 32 * 1000, 32 * 2000]), torch.tensor([32 * 1000] * 3)
    ks = torch.tensor([9000, 7777, 0])
    got, counts = _scan_once(x, block_abs_max(x), offsets, numels, torch.zeros(3), ks)
    assert counts.tolist() == [9000, 7777, 0]
    first, second = got.split([9000, 7777])
    # ties: |x| in {0..4}, each 4 and 3 about 2/9 of 32,000 places, so 9000 takes every
    # 4 and the first 3s: a stable sort by |x| descending, then back in position order
    by_size = torch.sort(-x[:32000].abs(), stable=True).indices[:9000]
    assert 7000 < int((x[:32000].abs() == 4).sum()) < 9000
    assert torch.equal(first, torch.sort(by_size).values)
    part = x[32000:64000].abs()
    exact = torch.sort(torch.topk(part, 7777).indices).values + 32000
    assert torch.equal(second, exact)


@pytest.mark.parametrize("blocks", [200, 600])  # candidates < and > the radix's 16,384
def test_kernel_scan_keeps_the_k_largest_by_either_select(blocks):
    """DGC's final density leaves a few thousand candidates per tensor, which an
    nth_element selects (two 64k histograms per tensor cost more); more go through the
    radix select. Both: the k largest, ties the first in position, in position order."""
    from hvd_dgc.torch.memory import block_abs_max
    gen = torch.Generator().manual_seed(blocks)
    n = 32 * blocks
    x = torch.randn(2 * n, generator=gen)
    x[:n] = torch.randint(-6, 7, (n,), generator=gen).float()  # ties
    ks = [n // 5, n // 3]
    got, counts = _scan_once(
        x, block_abs_max(x), torch.tensor([0, n]), torch.tensor([n, n]), torch.zeros(2),
        torch.tensor(ks))
    assert counts.tolist() == ks
    for segment, (part, k) in enumerate(zip(got.split(ks), ks)):
        lo = segment * n
        by_size = torch.sort(-x[lo:lo + n].abs(), stable=True).indices[:k] + lo
        assert torch.equal(part, torch.sort(by_size).values)


def test_horovod_compression_names_resolve_to_dgc_with_their_value_format():
    """hvd_dgc/switch.py with the torch namespace: Horovod's none/fp16 (class or instance)
    mean DGC with fp32/fp16 values; names in any case; classes instantiated; the rest refused."""
    from horovod.torch.compression import Compressor, NoneCompressor
    from hvd_dgc.switch import dense_requested, resolve_compression
    from hvd_dgc.torch.collective import ExchangeCompressor
    from hvd_dgc.torch.compression import SparseCompressor, TopKCompressor

    def resolve(c):
        return resolve_compression(c, Compression, (SparseCompressor, ExchangeCompressor),
                                   "torch")
    assert resolve(Compression.none) == (Compression.dgc, False, "none")
    assert resolve(NoneCompressor()) == (Compression.dgc, False, "none")
    assert resolve(Compression.fp16) == (Compression.dgc, True, "fp16")
    assert resolve(" FP16 ") == (Compression.dgc, True, "fp16")
    assert resolve("topk").compressor is Compression.topk
    assert isinstance(resolve(TopKCompressor).compressor, TopKCompressor)
    assert resolve(Compression.powersgd).compressor is Compression.powersgd
    with pytest.raises(ValueError, match="'dgcc' is not a compressor name; use one of .*'dgc'"):
        resolve("dgcc")

    class Custom(Compressor):
        pass
    with pytest.raises(TypeError, match="Custom is a class hvd_dgc cannot use"):
        resolve(Custom)
    with pytest.raises(TypeError, match="density=1.0 trains dense"):
        resolve(Custom())
    assert dense_requested(1.0, None) and dense_requested(1, 0)
    assert not dense_requested(1.0, 4) and not dense_requested(None, None)
    assert not dense_requested(True, None) and not dense_requested(0.5, None)


def test_momentum_masking_only_where_its_tail_is_small():
    from hvd_dgc.masking import check_masking, masking_density_limit
    limit = masking_density_limit("auto", 0.9)
    assert limit == pytest.approx(0.1 * 0.1 / 0.9)
    assert 0.001 <= limit and 0.004 <= limit and not 0.015625 <= limit  # paper's stages
    assert masking_density_limit(True, 0.9) == math.inf
    assert masking_density_limit(False, 0.9) == -1.0
    assert masking_density_limit("auto", 0.0) == -1.0  # no momentum: nothing to mask
    assert masking_density_limit("auto", 0.99) == pytest.approx(0.1 * 0.01 / 0.99)
    for bad in (1, 0, "yes", None):
        with pytest.raises(ValueError, match="momentum_masking must be True"):
            check_masking(bad)


def test_default_schedule_warms_up_by_steps_when_the_script_sets_nothing():
    s = as_schedule()
    assert (s.density, s.warmup, s.unit) == (0.001, 10000, "step")
    assert s.boundaries == (160, 640, 2500, 10000)
    assert [s(step, 0.0) for step in (0, 159, 160, 639, 640, 2499, 2500, 9999, 10000)] == \
        [0.25, 0.25, 0.0625, 0.0625, 0.015625, 0.015625, 0.004, 0.004, 0.001]
    # the rule: every coordinate could have travelled DEFAULT_SENDS times by any step
    # past the first stage, and the stages are the paper's
    assert all(s(t, 0) * t >= DEFAULT_SENDS for t in range(160, 20000))
    assert s.describe() == ("warm-up 0.25 to step 160, 0.0625 to step 640, 0.01562 to "
                            "step 2500, 0.004 to step 10000")
    adaptive = as_schedule(adaptive=True)  # Adam & co.: ADAPTIVE_SENDS, 4x longer stages
    assert adaptive.boundaries == (640, 2560, 10000, 40000)
    assert all(adaptive(t, 0) * t >= ADAPTIVE_SENDS for t in range(640, 80000, 7))
    tighter = DensitySchedule.coverage(0.01, sends=5)  # stages below 1% are raised to it
    assert tighter.boundaries == (80, 320, 500, 500) and tighter(499, 0) == 0.015625
    with pytest.raises(ValueError, match="sends must be a number > 0"):
        DensitySchedule.coverage(0.001, sends=0)
    with pytest.raises(ValueError, match="boundaries must be 4 increasing"):
        DensitySchedule(0.001, warmup=4, boundaries=(1, 3, 2, 4))
    assert as_schedule(0.01).warmup == 0            # density given: no implicit warm-up
    assert as_schedule(None, 0).density == 0.001    # warmup=0: none
    assert as_schedule(None, 4).unit == "epoch"


# -- delay="auto" (hvd_dgc/autodelay.py) -------------------------------------------------
def test_auto_delay_covers_the_measured_exchange_with_its_margin():
    from hvd_dgc.autodelay import AutoDelay, choose_delay
    cfg = AutoDelay(max_delay=8, margin=1.25)
    # D=2, each step waited one step's compute: the exchange took 3 steps -> ceil(3.75)
    assert choose_delay(2, compute_s=10.0, wait_s=10.0, steps=10, config=cfg) == 4
    # period 4: one step in 4 waits; 0.25 per step = 1 step per exchange -> same 4
    assert choose_delay(2, 10.0, 2.5, 10, cfg, period=4) == 4
    # a long exchange is capped at max_delay
    assert choose_delay(2, 1.0, 100.0, 10, cfg) == 8
    # no wait worth the name (below idle): one step less, never below 1
    assert choose_delay(5, 10.0, 0.4, 10, cfg) == 4
    assert choose_delay(1, 10.0, 0.0, 10, cfg) == 1
    # nothing measured: unchanged
    assert choose_delay(3, 0.0, 0.0, 0, cfg) == 3


def test_auto_delay_state_decides_from_the_window_it_was_given():
    from hvd_dgc.autodelay import AutoDelay, AutoDelayState
    state = AutoDelayState(AutoDelay(max_delay=6, window=2, start=2))
    state.observe(0.1, 0.1)
    assert not state.window_done()
    state.observe(0.1, 0.1)
    sums = state.take_window()
    assert sums == (0.2, 0.2, 2.0, 2.0) and state.steps == 0
    assert state.decide(sums, step=7) == 4 and state.decisions == [(7, 4)]
    # a window measured under a D since replaced decides nothing
    assert state.decide(sums, step=9) == 4 and state.decisions == [(7, 4)]


def test_auto_delay_arguments():
    from hvd_dgc.autodelay import AutoDelay, as_auto_delay
    assert as_auto_delay(3) == (3, None)
    assert as_auto_delay("AUTO") == (None, AutoDelay())
    assert as_auto_delay(AutoDelay(max_delay=16)) == (None, AutoDelay(max_delay=16))
    for bad, words in (("soon", '"auto"'), (-1, "int >= 0"), (True, "int >= 0"),
                       (AutoDelay(window=0), "window must be an int >= 1"),
                       (AutoDelay(margin=0.5), "margin must be a number >= 1"),
                       (AutoDelay(idle=1.0), "idle must be a number in [0, 1)")):
        with pytest.raises(ValueError, match=re.escape(words)):
            as_auto_delay(bad)


# ---------------------------------------------------------------- fp16 on the dense wire

def test_fp16_bound_keeps_every_sum_of_n_ranks_finite():
    import numpy as np
    from hvd_dgc.fp16wire import FP16_MAX, fp16_bound
    assert fp16_bound(1) == FP16_MAX
    assert fp16_bound(2) == 32736.0  # the fp16 number below 65504 / (2 (1 + 2^-11))
    for world in (2, 3, 4, 5, 7, 8, 16, 64, 512):
        for prescale in (1.0, 0.5, 1 / 3):
            bound = fp16_bound(world, prescale)
            assert float(np.float16(bound)) == bound  # clipped values cast exactly
            top = np.float16(np.float32(bound) * np.float32(prescale))  # Horovod's prescale
            total = np.float16(0)
            for _ in range(world):  # fp16 additions, every one rounding (here: up)
                total = np.float16(np.float32(total) + np.float32(top))
            assert np.isfinite(total), (world, prescale, total)
        # not needlessly small: within 1% (N <= 16) of the exact share of 65504
        if world <= 16:
            assert bound > 0.99 * FP16_MAX / world


def test_fp16_payload_sends_what_fits_and_keeps_the_rest():
    import numpy as np
    from hvd_dgc.fp16wire import fp16_payload
    v = np.array([1e5, -7e4, 32736.0, 3.0, 0.1, np.inf, np.nan, -np.inf], np.float32)
    payload, residual, clipped = fp16_payload(v, 2)
    assert payload.dtype == np.float16 and residual.dtype == np.float32
    assert clipped == 2  # 1e5 and -7e4; 32736 is the bound itself; non-finite ones are not
    np.testing.assert_array_equal(payload[:4], np.float16([32736, -32736, 32736, 3]))
    np.testing.assert_array_equal(residual[:4], np.float32([67264, -37264, 0, 0]))
    # fp16's rounding stays: payload + residual == v exactly for finite values
    finite = np.isfinite(v)
    np.testing.assert_array_equal(payload[finite].astype(np.float32) + residual[finite],
                                  v[finite])
    assert residual[4] != 0
    # a non-finite value leaves as it is (skip_nonfinite sees it) and leaves nothing behind
    assert np.isposinf(payload[5]) and np.isnan(payload[6]) and np.isneginf(payload[7])
    np.testing.assert_array_equal(residual[5:], 0)


def test_gpu_form_selects_a_launch_from_its_buffer():
    """``select_span``, what the optimizer's pick runs on an accelerator: the tensors at
    their offsets in one buffer give ``select_many``'s records, with positions in the
    buffer; the sampling draws are the reference's, computed for every tensor at once."""
    from hvd_dgc.torch.cpu_select import draws
    from tests.reference import draw
    from hvd_dgc.torch.gpu_select import select_span
    from hvd_dgc.torch.memory import aligned_size
    gen = torch.Generator().manual_seed(9)
    sizes = (70_000, 3000, 1024, 250_000)
    ks = tuple(num_selected(n, 0.001) for n in sizes)
    offsets = (0,)
    for n in sizes[:-1]:
        offsets += (offsets[-1] + aligned_size(n),)
    buffer = torch.randn(offsets[-1] + aligned_size(sizes[-1]), generator=gen)
    keys = (3, "layer1.weight", 7, "fc.weight")
    for step in range(3):
        d = draws(11, 1, step, keys)
        assert d.tolist() == [draw(11, 1, step, key) for key in keys]
        span = select_span(buffer, offsets, sizes, ks, d)
        each = select_many([buffer[o:o + n] for o, n in zip(offsets, sizes)], ks, d.tolist())
        starts = torch.tensor(offsets).repeat_interleave(torch.tensor(ks))
        assert torch.equal(span.indices, each.indices + starts)
        assert torch.equal(span.values, each.values)
        assert torch.equal(buffer[span.indices][span.values != 0], span.values[span.values != 0])
        assert int((span.values != 0).sum()) >= 0.95 * sum(ks)


def test_draws_are_the_reference_splitmix64_for_any_coordinates():
    """``draws`` (NumPy's wrapping uint64, every tensor of a launch at once) and ``draw``
    (one key, what extensions call: docs/extending.md) give the reference's Python-integer
    splitmix64 bit for bit: large seeds and steps, int and name keys, negative ints."""
    import random
    from hvd_dgc.torch.cpu_select import draw, draws
    from tests import reference as ref
    rng = random.Random(1)
    for _ in range(300):
        seed, rank, step = rng.randrange(2 ** 63), rng.randrange(1024), rng.randrange(10 ** 9)
        keys = tuple(rng.choice([rng.randrange(2 ** 32), -rng.randrange(1, 99),
                                 f"layer{rng.randrange(99)}.weight"])
                     for _ in range(rng.randrange(1, 9)))
        want = [ref.draw(seed, rank, step, key) for key in keys]
        assert draws(seed, rank, step, keys).tolist() == want, (seed, rank, step, keys)
        assert [draw(seed, rank, step, key) for key in keys] == want
