"""Region reduce (hvd_dgc/aggregation.py) against a brute-force dense computation, its
conservation (error feedback), its receive volume, and the cost model's choice (issue 15).
Pure NumPy: no Horovod launch."""

import itertools
import zlib

import numpy as np
import pytest

from harness.aggregation_sim import simulate
from harness.shapes import numel, resnet50_shapes
from hvd_dgc import CostModel
from hvd_dgc.aggregation import (KEEP, allgather_bytes, bytes_per_worker, hierarchical_bytes,
                                 slice_k, quota, region_of, region_reduce_reference,
                                 regions, slices)
from hvd_dgc.resolve import aggregation_choices
from hvd_dgc.paths import AGGREGATION_OPTIONS, PathKind

DENSE, HIERARCHICAL, REGION, SPARSE = (PathKind.DENSE, PathKind.HIERARCHICAL, PathKind.REGION,
                                       PathKind.ALLGATHER)
from hvd_dgc.schedule import num_selected

WORLDS = (1, 2, 3, 4, 8)


# ---------------------------------------------------------------------------- helpers

def brute_force(selections, n, k):
    """Dense sums per region, top-quota per region by sorting (|v| desc, index asc).

    Independent of the module: R = min(N, 2k) regions (at least 1), region j =
    range(j, n, R), sums in a dense vector in rank order, selection by Python's sort
    over the touched indices."""
    world = len(selections)
    cut = max(1, min(world, 2 * k))
    dense = np.zeros(n, dtype=np.result_type(*[np.asarray(v).dtype for _, v in selections]))
    touched = np.zeros(n, dtype=bool)
    for idx, val in selections:
        dense[idx] += val
        touched[idx] = True
    q = -(-KEEP * k // cut) if k else 1
    kept, returned = [], []
    for block in (range(j, n, cut) if j < cut else () for j in range(world)):
        cand = [int(i) for i in block if touched[i]]
        cand.sort(key=lambda i: (-abs(dense[i]), i))
        kept += cand[:q]
        returned.append(sorted(cand[q:]))
    return dense, touched, sorted(kept), returned


def densify(n, idx, val, dtype=np.float64):
    out = np.zeros(n, dtype=dtype)
    np.add.at(out, idx, val)
    return out


def random_case(rng, world, n, k, mode, dtype=np.float64):
    """Each rank selects up to k distinct indices: 'overlap' (from the whole range, so
    ranks collide), 'disjoint' (a permutation dealt out), 'ragged' (0..k per rank)."""
    sels = []
    perm = rng.permutation(n)
    for r in range(world):
        if mode == "disjoint":
            idx = perm[r * k:(r + 1) * k]
        else:
            size = min(n, k if mode == "overlap" else int(rng.integers(0, k + 1)))
            idx = rng.choice(n, size=size, replace=False)
        sels.append((np.asarray(idx, dtype=np.int64),
                     rng.standard_normal(len(idx)).astype(dtype)))
    return sels


CASES = []  # (world, n, k, mode)
for _world in WORLDS:
    for _n, _k in ((97, 10), (1001, 40), (50, 20), (13, 13), (8, 3), (5, 3)):
        for _mode in ("overlap", "disjoint", "ragged"):
            if _mode == "disjoint" and _k * _world > _n:
                continue
            CASES.append((_world, _n, _k, _mode))


# ---------------------------------------------------------------------------- regions

@pytest.mark.parametrize("n", [0, 1, 5, 7, 8, 13, 64, 97, 1001])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8, 16])
def test_slices_partition_and_regions_interleave(n, world):
    rs = slices(n, world)
    expected = [(int(b[0]), int(b[-1]) + 1) if b.size else None
                for b in np.array_split(np.arange(n), world)]
    sizes = [stop - start for start, stop in rs]
    assert len(rs) == world and rs[0][0] == 0 and rs[-1][1] == n
    assert all(rs[j][1] == rs[j + 1][0] for j in range(world - 1))
    assert sizes == [n // world + (1 if j < n % world else 0) for j in range(world)]
    assert [r if r[1] > r[0] else None for r in rs] == expected
    # region reduce's owners: every N-th index, so each owner sees the whole tensor
    owner = region_of(np.arange(n), n, world, n)
    for j in range(world):
        np.testing.assert_array_equal(np.flatnonzero(owner == j), np.arange(j, n, world))


def test_region_of_and_quota_refuse_bad_input():
    with pytest.raises(ValueError, match=r"\[0, 10\)"):
        region_of([3, 10], 10, 2, 3)
    with pytest.raises(ValueError, match=r"\[0, 10\)"):
        region_of([-1], 10, 2, 3)
    with pytest.raises(ValueError, match="world"):
        slices(10, 0)
    with pytest.raises(ValueError, match="k must"):
        quota(-1, 4)
    # ceil(2k / R), at least 1 (KEEP = 2), of R = min(N, 2k) regions (at least 1)
    assert [quota(k, 4) for k in (0, 1, 4, 5, 8, 9)] == [1, 1, 2, 3, 4, 5]
    assert [regions(k, 4) for k in (0, 1, 4, 5, 8, 9)] == [1, 2, 4, 4, 4, 4]
    assert quota(25585, 1024) == 50 and quota(7, 1) == 14
    # few records on many ranks: 2k regions of one sum each, not N
    assert regions(64, 1024) == 128 and quota(64, 1024) == 1
    assert regions(511, 1024) == 1022 and quota(511, 1024) == 1
    assert regions(513, 1024) == 1024 and quota(513, 1024) == 2
    with pytest.raises(ValueError, match="world"):
        regions(3, 0)


def test_reference_refuses_bad_selections():
    with pytest.raises(ValueError, match="more than k"):
        region_reduce_reference([(np.arange(5), np.ones(5))], 10, 4)
    with pytest.raises(ValueError, match="repeated"):
        region_reduce_reference([(np.array([1, 1]), np.ones(2))], 10, 4)
    with pytest.raises(ValueError, match="one length"):
        region_reduce_reference([(np.array([1, 2]), np.ones(3))], 10, 4)
    with pytest.raises(ValueError, match=r"\[0, 10\)"):
        region_reduce_reference([(np.array([10]), np.ones(1))], 10, 4)


# ---------------------------------------------------------------------------- reference

@pytest.mark.parametrize("world,n,k,mode", CASES)
def test_reference_matches_brute_force_and_conserves(world, n, k, mode):
    rng = np.random.default_rng(zlib.crc32(repr((world, n, k, mode)).encode()))
    sels = random_case(rng, world, n, k, mode)
    res = region_reduce_reference(sels, n, k)
    dense, touched, kept, returned = brute_force(sels, n, k)

    # the update: brute force's kept indices, values = the dense sums (same rank order)
    assert res.indices.dtype == np.int64
    np.testing.assert_array_equal(res.indices, kept)
    np.testing.assert_array_equal(res.values, dense[kept])
    assert (np.diff(res.indices) > 0).all()
    # each owner keeps at most quota, from its own region
    owner = region_of(res.indices, n, world, k)
    assert owner.max(initial=0) < regions(k, world)
    assert np.bincount(owner, minlength=world).max(initial=0) <= quota(k, world)
    # what each owner returns: the rest of its region's sum, at its own indices
    assert len(res.returned) == world
    for j, (idx, val) in enumerate(res.returned):
        np.testing.assert_array_equal(idx, returned[j])
        np.testing.assert_array_equal(val, dense[returned[j]])
        assert (region_of(idx, n, world, k) == j).all()
    # conservation, exact in float64: kept + returned == everything sent
    total = densify(n, res.indices, res.values)
    for idx, val in res.returned:
        total += densify(n, idx, val)
    np.testing.assert_array_equal(total, dense)
    assert not total[~touched].any()

    # receive volume: alltoall from others + the other owners' kept records
    sizes = [len(i) for i, _ in sels]
    kept_per_owner = np.bincount(owner, minlength=world)
    for j in range(world):
        from_others = sum(int((region_of(sels[i][0], n, world, k) == j).sum())
                          for i in range(world) if i != j)
        assert res.received_records[j] == from_others + kept_per_owner.sum() - kept_per_owner[j]
        allgather = sum(sizes) - sizes[j]
        # a hard bound for any input: allgather's plus the other owners' quotas
        assert res.received_records[j] <= allgather + (world - 1) * quota(k, world)
        if world >= 4 and mode != "ragged":  # 3k(N-1)/N against k(N-1)
            assert res.received_records[j] <= allgather


def test_reference_float32_conserves_within_rounding():
    rng = np.random.default_rng(7)
    for world in WORLDS:
        sels = random_case(rng, world, 1001, 60, "overlap", dtype=np.float32)
        res = region_reduce_reference(sels, 1001, 60)
        assert res.values.dtype == np.float32
        sent = np.zeros(1001)
        for idx, val in sels:
            sent[idx] += val.astype(np.float64)
        total = densify(1001, res.indices, res.values.astype(np.float64))
        for idx, val in res.returned:
            total += densify(1001, idx, val.astype(np.float64))
        np.testing.assert_allclose(total, sent, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("world", WORLDS)
def test_error_feedback_identity_with_memory(world):
    """sum(memory after) + kept == sum(memory before), exactly: values are multiples of
    2**-10, so every float64 sum is exact whatever its order."""
    rng = np.random.default_rng(world)
    n, k = 203, 17
    # region 0's indices four times larger: ranks' selections crowd it past its quota
    crowd = np.where(np.arange(n) % world == 0, 4, 1)
    before = [crowd * rng.integers(-4096, 4096, n) / 1024.0 for _ in range(world)]
    sels, after = [], []
    for mem in before:
        idx = np.sort(np.argsort(-np.abs(mem), kind="stable")[:k]).astype(np.int64)
        sels.append((idx, mem[idx].copy()))
        rest = mem.copy()
        rest[idx] = 0.0
        after.append(rest)
    res = region_reduce_reference(sels, n, k)
    for owner, (idx, val) in enumerate(res.returned):
        after[owner][idx] += val
    returned_any = sum(len(i) for i, _ in res.returned)
    # N = 1 keeps all k; otherwise the re-sparsified part is exercised
    assert (returned_any > 0) == (world > 1)
    lhs = sum(after) + densify(n, res.indices, res.values)
    np.testing.assert_array_equal(lhs, sum(before))
    assert len(res.indices) <= world * quota(k, world)


@pytest.mark.parametrize("world", WORLDS)
def test_density_one_returns_nothing_and_equals_dense_sum(world):
    rng = np.random.default_rng(10 + world)
    n = 37
    sels = [(np.arange(n, dtype=np.int64), rng.standard_normal(n)) for _ in range(world)]
    res = region_reduce_reference(sels, n, n)
    assert all(len(i) == 0 and len(v) == 0 for i, v in res.returned)
    np.testing.assert_array_equal(res.indices, np.arange(n))
    dense = np.zeros(n)
    for _, v in sels:
        dense += v
    np.testing.assert_array_equal(res.values, dense)
    # owner j receives its region from the N-1 others, then every other region
    for j in range(world):
        size = len(range(j, n, world))
        assert res.received_records[j] == (world - 1) * size + n - size


def test_ties_go_to_the_lower_index():
    # k = 2, N = 4: quota ceil(2 * 2 / 4) = 1 per region, regions {0, 4}, {1, 5}, ...
    none = (np.array([], dtype=np.int64), np.array([]))
    sels = [(np.array([0, 1]), np.array([-2.0, 2.0])), (np.array([4, 5]), np.array([2.0, 2.0])),
            none, none]
    res = region_reduce_reference(sels, 8, 2)
    np.testing.assert_array_equal(res.indices, [0, 1])
    np.testing.assert_array_equal(res.values, [-2.0, 2.0])
    assert [list(i) for i, _ in res.returned] == [[4], [5], [], []]
    # a larger |sum| wins over a lower index; sums, not single records, are compared
    sels = [(np.array([0, 1]), np.array([1.0, 2.0])), (np.array([1, 4]), np.array([0.5, -1.5])),
            none, none]
    res = region_reduce_reference(sels, 8, 2)
    np.testing.assert_array_equal(res.indices, [1, 4])
    np.testing.assert_array_equal(res.values, [2.5, -1.5])
    assert [list(v) for _, v in res.returned] == [[1.0], [], [], []]


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_balanced_receive_volume_is_the_formula(world):
    rng = np.random.default_rng(100 + world)
    per_region, width = 5, 40
    n, k = world * width, world * per_region
    sels = []
    for _ in range(world):
        idx = np.concatenate([j + world * rng.choice(width, per_region, replace=False)
                              for j in range(world)])
        sels.append((np.sort(idx).astype(np.int64), rng.standard_normal(k)))
    res = region_reduce_reference(sels, n, k)
    formula = k * (world - 1) // world + quota(k, world) * (world - 1)
    assert formula * 8 == bytes_per_worker("region", n, k, world)
    # an owner whose region's union holds fewer than quota sums keeps them all
    kept = [min(quota(k, world), int(np.unique(np.concatenate(
        [i[i % world == j] for i, _ in sels])).size))
        for j in range(world)]
    assert res.received_records == [k * (world - 1) // world + sum(kept) - kept[j]
                                    for j in range(world)]
    assert all(r <= formula for r in res.received_records)
    assert len(res.indices) == sum(kept)
    if world >= 3:  # allgather's k(N-1) is more (N = 3: equal)
        assert formula <= k * (world - 1)


def test_all_indices_in_one_region_and_the_crossing_worst_case():
    # every index in region 0: its owner receives exactly allgather's k(N-1)
    world, n, k = 4, 400, 20
    rng = np.random.default_rng(3)
    sels = [(world * np.sort(rng.choice(100, k, replace=False)).astype(np.int64),
             rng.standard_normal(k)) for _ in range(world)]
    res = region_reduce_reference(sels, n, k)
    assert res.received_records[0] == k * (world - 1)
    assert res.received_records[1:] == [quota(k, world)] * (world - 1)
    # N = 2, each rank's indices all in the other's region: k + quota > allgather's k
    sels = [(np.arange(51, 71, 2), np.ones(10)), (np.arange(0, 20, 2), np.ones(10))]
    res = region_reduce_reference(sels, 100, 10)
    assert res.received_records == [10 + 10, 10 + 10]


# ---------------------------------------------------------------------------- bytes

def test_bytes_per_worker_formulas():
    assert bytes_per_worker("dense", 1000, 80, 8) == 2 * 7 / 8 * 1000 * 4
    assert bytes_per_worker("allgather", 1000, 80, 8) == 7 * 80 * 8
    assert bytes_per_worker("region", 1000, 80, 8) == (70 + 20 * 7) * 8  # quota ceil(160/8)
    assert bytes_per_worker("region", 1000, 80, 8, value_bytes=2) == (70 + 140) * 6
    assert bytes_per_worker("dense", 1000, 80, 8, dense_value_bytes=2) == 3500
    assert [bytes_per_worker(m, 1000, 80, 1) for m in ("dense", "allgather", "region")] == [0] * 3
    with pytest.raises(ValueError, match="method"):
        bytes_per_worker("ring", 1000, 80, 8)


@pytest.mark.parametrize("n", [25_557_032, 2_359_296, 1_048_576])
def test_region_bytes_flat_allgather_linear(n):
    k = num_selected(n, 0.001)
    region = {w: bytes_per_worker("region", n, k, w) for w in (8, 1024)}
    allgather = {w: bytes_per_worker("allgather", n, k, w) for w in (8, 1024)}
    assert region[1024] / region[8] <= 2.0
    assert allgather[1024] / allgather[8] == pytest.approx(1023 / 7)  # >= 128x
    assert region[8] <= allgather[8] / 2
    # and the cost model's time agrees with the bytes
    cm = CostModel()
    for w in (2, 8, 1024):
        assert cm.region_seconds(k, w, 4, 4) == pytest.approx(
            2 * (w - 1) * cm.alpha + bytes_per_worker("region", n, k, w) / cm.bandwidth)
        assert cm.sparse_seconds(k, w, 4, 4) == pytest.approx(
            (w - 1) * cm.alpha + bytes_per_worker("allgather", n, k, w) / cm.bandwidth)
        assert cm.dense_seconds(n, w, 4) == pytest.approx(
            2 * (w - 1) * cm.alpha + bytes_per_worker("dense", n, k, w) / cm.bandwidth)


def test_simulator_resnet50():
    shapes = resnet50_shapes()
    per_tensor = {r["world"]: r for r in simulate(shapes, 0.001, (2, 8, 1024))}
    fused = {r["world"]: r for r in simulate(shapes, 0.001, (2, 8, 1024), fused=True)}
    # per tensor, rows are the sum of bytes_per_worker (small tensors dense)
    expect = sum(bytes_per_worker("dense" if numel(s) < 1024 else "region", numel(s),
                                  num_selected(numel(s), 0.001), 8) for _, s in shapes)
    assert per_tensor[8]["region_bytes"] == pytest.approx(expect)
    for rows in (per_tensor, fused):
        assert rows[8]["region_bytes"] <= rows[8]["allgather_bytes"] / 2
        # N = 2: k/2 in, then quota = k back: up to 1.5x allgather's (the cost model
        # keeps allgather there)
        assert rows[2]["allgather_bytes"] < rows[2]["region_bytes"] \
            <= 1.5 * rows[2]["allgather_bytes"]
        assert rows[1024]["allgather_bytes"] / rows[8]["allgather_bytes"] > 100
        assert rows[1024]["dense_bytes"] == pytest.approx(per_tensor[1024]["dense_bytes"])
    # fused (one quota): flat. Per tensor, a tensor of k < N/2 has 2k regions, not N
    # (aggregation.regions; N regions would keep N records: 1.87x from N = 8 to 1024 on
    # ResNet-50): 1.30x
    assert fused[1024]["region_bytes"] / fused[8]["region_bytes"] <= 1.2
    assert 1.2 < per_tensor[1024]["region_bytes"] / per_tensor[8]["region_bytes"] <= 1.35


# ---------------------------------------------------------------------------- cost model

def test_choose_aggregation_without_region_is_choose():
    numels = [1, 2, 7, 100, 1024, 10 ** 5, 10 ** 6, 25_557_032]
    fracs = [0.0, 1e-4, 1e-3, 0.01, 0.1, 0.25, 0.5, 0.99, 1.0, 1.5]
    for cm in (CostModel(), CostModel(alpha=0.0), CostModel(alpha=1e-3, bandwidth=1e10)):
        for n, f, world, dw, sw in itertools.product(numels, fracs, (1, 2, 3, 8, 64, 1024),
                                                     (2, 4), (2, 4)):
            k = max(1, int(n * f))
            assert cm.choose_aggregation(n, k, world, dw, sw, 4, allowed=(DENSE, SPARSE)) \
                == cm.choose(n, k, world, dw, sw, 4), (n, k, world, dw, sw)
            full = cm.choose_aggregation(n, k, world, dw, sw, 4)
            if world <= 2:
                assert full == cm.choose(n, k, world, dw, sw, 4)  # np=1, np=2: today's choice
            if k >= n:
                assert full == DENSE


def test_dense_tensors_fold_into_the_allgather_up_to_the_break_even():
    # (N-1) n (w+i) / B <= 2 (N-1) alpha + 2 (N-1)/N n w / B
    #   <=>  n <= 2 alpha B / ((w+i) - 2w/N): N=2, fp32 values, 50 us, 1 Gbit/s -> 3125
    cm = CostModel()
    assert cm.folds(3125, 2) and not cm.folds(3126, 2)
    assert cm.folds(2083, 4) and not cm.folds(2084, 4)  # N = 4: 12500 / 6
    assert not CostModel(alpha=0.0).folds(1, 2)  # without latency, never
    wan = CostModel(alpha=0.1, bandwidth=12.5e6)  # 200 ms of round trip, 100 Mbit/s
    assert wan.folds(100_000, 8) and not wan.folds(1_000_000, 8)
    assert not cm.folds(10, 1) and not cm.folds(0, 2)  # nothing to save


def test_choose_aggregation_picks_region_at_scale():
    cm = CostModel()
    shapes = [s for _, s in resnet50_shapes()]
    whole = sum(numel(s) for s in shapes)
    k_whole = sum(num_selected(numel(s), 0.001) for s in shapes)
    for world in (8, 64, 1024):
        assert cm.choose_aggregation(whole, k_whole, world) == REGION
        assert cm.choose_aggregation(2_359_296, 2360, world) == REGION  # layer4 conv2
    assert cm.choose_aggregation(whole, k_whole, 2) == SPARSE
    assert cm.choose_aggregation(whole, k_whole, 1) == SPARSE
    # more bytes at N = 2, equal at N = 3 (alpha 0, k divisible by 3): allgather both
    cm0 = CostModel(alpha=0.0)
    assert cm0.region_seconds(1000, 2, 4, 4) > cm0.sparse_seconds(1000, 2, 4, 4)
    assert cm0.region_seconds(999, 3, 4, 4) == cm0.sparse_seconds(999, 3, 4, 4)
    assert cm0.choose_aggregation(10 ** 6, 1000, 2) == SPARSE
    assert cm0.choose_aggregation(10 ** 6, 999, 3) == SPARSE
    # a small tensor at large N: latency keeps it on allgather
    assert cm.choose_aggregation(4096, 5, 1024) == SPARSE
    # a single allowed name forces it (not dense for k >= numel unless allowed)
    assert cm.choose_aggregation(100, 100, 8, allowed=REGION) == REGION
    assert cm.choose_aggregation(10 ** 6, 10, 8, allowed=(DENSE,)) == DENSE


def test_choose_aggregation_refuses_unknown_names():
    cm = CostModel()
    with pytest.raises(ValueError, match="allgather"):
        cm.choose_aggregation(1000, 10, 8, allowed=(DENSE, "allgather"))
    with pytest.raises(ValueError, match="allowed"):
        cm.choose_aggregation(1000, 10, 8, allowed=())
    with pytest.raises(ValueError, match="regoin"):
        cm.choose_aggregation(1000, 10, 8, allowed="regoin")


# ------------------------------------------------------------------- hierarchical DGC

def test_slices_share_k_and_a_host_sends_k_records():
    """Each of L slices selects its share of k rounded up: a host sends between k and
    k + L records where flat DGC's L ranks send L k; the allgather's bytes say so."""
    for n, k, local in itertools.product((1, 3, 1000, 2_359_296), (1, 7, 2360), (2, 3, 4, 8)):
        k = min(k, n)
        sizes = [hi - lo for lo, hi in slices(n, local)]
        shares = [slice_k(k, n, s) for s in sizes]
        assert all(0 <= c <= s for c, s in zip(shares, sizes))
        assert k <= sum(shares) <= k + local, (n, k, local, shares)
    assert slice_k(10, 100, 0) == 0
    assert hierarchical_bytes(2360, 8, 4, 8) == 7 * 590 * 8
    assert hierarchical_bytes(2360, 8, 4, 8) <= allgather_bytes(2360, 8, 8) / 4


def test_hierarchical_cost_and_choice():
    cm = CostModel()
    n, k = 2_359_296, 2360  # ResNet-50's largest conv at 0.1%
    expect = (3 * cm.local_alpha + 3 / 4 * n * 4 / cm.local_bandwidth + 7 * cm.alpha
              + hierarchical_bytes(k, 8, 4, 8) / cm.bandwidth)
    assert cm.hierarchical_seconds(n, k, 8, 4, 4, 4, 4) == pytest.approx(expect)
    # a candidate only where ranks share hosts and there are several hosts
    slow = CostModel(bandwidth=100e6 / 8)
    assert slow.choose_aggregation(n, k, 8, allowed=AGGREGATION_OPTIONS["auto"],
                                   local_size=4) == HIERARCHICAL
    for local in (1, 8):  # one rank per host, or one host
        assert slow.choose_aggregation(n, k, 8, allowed=AGGREGATION_OPTIONS["auto"],
                                       local_size=local) != HIERARCHICAL
    # at 1 Gbit/s and 0.1% the records it saves cost less than the dense local step
    assert cm.choose_aggregation(n, k, 8, allowed=AGGREGATION_OPTIONS["auto"],
                                 local_size=4) != HIERARCHICAL
    assert cm.choose_aggregation(n, k, 8, allowed=(HIERARCHICAL,), local_size=4) \
        == HIERARCHICAL
    assert HIERARCHICAL not in AGGREGATION_OPTIONS["flat"]
    with pytest.raises(ValueError, match="local_bandwidth"):
        CostModel(local_bandwidth=0)


def test_aggregation_option_is_checked_once_for_both_frameworks():
    assert aggregation_choices("auto", True, "x", "y") == AGGREGATION_OPTIONS["auto"]
    with pytest.raises(ValueError, match=r"one of \['allgather', 'auto', 'dense', 'flat', "
                                         r"'hierarchical', 'region'\], got 'regoin'"):
        aggregation_choices("regoin", True, "x", "y")
    for forced in ("allgather", "region", "hierarchical"):
        with pytest.raises(ValueError, match="Compression.dgc, or aggregation='auto'"):
            aggregation_choices(forced, False, "PowerSGD", "hvd_dgc.torch.Compression.dgc")
