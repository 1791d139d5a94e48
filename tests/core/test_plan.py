"""The planner (hvd_dgc/plan.py): the decisions every rank must make alike, shared by
PyTorch and TensorFlow. No Horovod job needed: it is framework-free."""

import pytest

from hvd_dgc import CostModel
from hvd_dgc.config import DGCConfig
from hvd_dgc.consistency import optimizer_consistency
from hvd_dgc.overlap import sums_send_sparse
from hvd_dgc.resolve import HorovodArguments
from hvd_dgc.fusion import BUCKET_LATENCIES
from hvd_dgc.packing import gather_record_bytes
from hvd_dgc.paths import PathKind
from hvd_dgc.plan import Planner, TensorInfo, hierarchical_hosts
from hvd_dgc.plan_words import PlanWords, exchange_collective
from hvd_dgc.schedule import num_selected
from hvd_dgc.torch.compression import Compression
from hvd_dgc.torch.optimizer import TORCH

ARGS = HorovodArguments("average", 1.0, 1, None, ("average", "sum", "adasum"))
TENSORS = [TensorInfo(0, "conv.weight", 64 * 64 * 9, (64, 64, 3, 3)),
           TensorInfo(1, "conv.bias", 64, (64,)),
           TensorInfo(2, "fc.weight", 1000 * 512, (1000, 512)),
           TensorInfo(3, "fc.bias", 1000, (1000,)),
           TensorInfo(4, "emb.weight", 5000 * 16, (5000, 16), sliced=True)]


def _planner(world=4, local_size=0, compression=Compression.dgc, **options):
    resolved = DGCConfig(**options).resolve(TORCH, compression, ARGS, (True, "SGD"))
    return Planner(resolved, TENSORS, world, local_size)


def test_each_tensor_takes_the_path_the_cost_model_chooses():
    planner = _planner(density=0.001, warmup=0)
    model = CostModel()
    for t in TENSORS:
        path = planner.path(t, 0.001)
        if t.sliced:
            assert path == PathKind.SPARSE_GRAD
        elif t.numel < 1024:
            assert path == PathKind.DENSE
        else:
            assert path == model.choose_aggregation(
                t.numel, num_selected(t.numel, 0.001), 4, 4, 4,
                allowed=(PathKind.DENSE, PathKind.ALLGATHER, PathKind.REGION))
    assert planner.path(TENSORS[2], 0.001) == PathKind.ALLGATHER
    assert planner.path(TENSORS[2], 1.0) == PathKind.DENSE  # everything selected: dense


def test_a_trial_sends_every_flat_tensor_dense_at_its_density_alone():
    """Keras' trial of the step's own time (hvd_dgc/tensorflow/plan_trial.py): at the
    density tried, or kept dense, every flat tensor goes dense, the other densities keep
    the sums' plan, the generation moves (the link watch's baseline starts afresh), a
    new link clears it (tried again on the new numbers), and a sparse aggregation the
    script forced is never tried."""
    planner = _planner(density=0.001, warmup=0)
    fc, emb = TENSORS[2], TENSORS[4]
    assert sums_send_sparse(planner, 0.001) and not sums_send_sparse(planner, 1.0)
    generation = planner.generation
    planner.force_dense(0.001, True)
    assert planner.path(fc, 0.001) == PathKind.DENSE
    assert planner.path(emb, 0.001) == PathKind.SPARSE_GRAD  # (Horovod's own slices)
    assert planner.path(fc, 0.0625) == planner.summed_path(fc, 0.0625) != PathKind.DENSE
    assert sums_send_sparse(planner, 0.001)  # (what the sums would do: still sparse)
    assert planner.generation == generation + 1
    planner.force_dense(0.001, True)  # no change: the generation stays
    assert planner.generation == generation + 1
    planner.force_dense(0.001, False)
    assert planner.path(fc, 0.001) == PathKind.ALLGATHER and planner.generation == \
        generation + 2
    planner.force_dense(0.001, True)
    planner.relink(planner.link)  # (a probe's numbers; None keeps the model)
    assert planner.forced_dense == frozenset() and planner.path(fc, 0.001) == \
        PathKind.ALLGATHER
    forced = _planner(density=0.001, warmup=0, aggregation="allgather")
    assert not sums_send_sparse(forced, 0.001)
    forced.force_dense(0.001, True)  # (never asked for; held to the script's choice)
    assert forced.path(fc, 0.001) == PathKind.ALLGATHER


def test_the_plan_follows_the_world():
    """At 25% a large tensor's allgather costs more than its allreduce on many ranks: the
    choice for 2 ranks must not be kept for 32 (an elastic reset re-plans)."""
    planner = _planner(world=2, density=0.25, warmup=0)
    assert planner.path(TENSORS[2], 0.25) == PathKind.ALLGATHER
    planner.replan(32)
    assert planner.path(TENSORS[2], 0.25) != PathKind.ALLGATHER


def test_buckets_cut_consecutive_tensors_at_the_threshold():
    # a 10 ms link: every tensor's bytes take less than BUCKET_LATENCIES latencies
    planner = _planner(world=2, density=0.01, warmup=0, cost_model=CostModel(alpha=10e-3))
    order = list(reversed(TENSORS))  # backward order
    # a record: its value and its coded position (packing.gather_record_bytes)
    wires = {t.key: (num_selected(t.numel, 0.01) * gather_record_bytes(
        planner.compressor, t.numel, num_selected(t.numel, 0.01))
        if planner.path(t, 0.01) == PathKind.ALLGATHER else t.numel * 4) for t in TENSORS}
    # the largest first one's bytes: it shares a bucket with the next only when they fit
    one = planner.buckets(0.01, order, 10 ** 9)
    assert set(one) == {0, 1, 2, 3} and len({one[k] for k in one}) == 1  # not the slices
    tight = planner.buckets(0.01, order, wires[3] + wires[2])
    assert tight[3] == tight[2] == (3, 2) and tight[1] == tight[0] == (1, 0)
    assert planner.buckets(0.01, order, 0) == {}


def test_a_long_transfer_ends_its_bucket():
    """On the assumed link (50 us, 1 Gbit/s) fc.weight's 5,120 records with fp32 values
    (about 27 KB, 0.2 ms) take more than BUCKET_LATENCIES x 50 us: its bucket (fc.bias,
    then it, in backward order) closes with it, so nothing after it holds it back;
    conv's tensors start the next. Cut at the threshold alone, all four shared one
    bucket."""
    planner = _planner(world=2, density=0.01, warmup=0,
                       compression=Compression.dgc(value_bits=32))
    model = planner.cost_model
    fc = TENSORS[2]
    assert planner.path(fc, 0.01) == PathKind.ALLGATHER
    k = num_selected(fc.numel, 0.01)
    seconds = k * gather_record_bytes(planner.compressor, fc.numel, k) / \
        model.records_bandwidth
    assert seconds > BUCKET_LATENCIES * model.alpha
    plan = planner.buckets(0.01, list(reversed(TENSORS)), 10 ** 9)
    assert plan == {3: (3, 2), 2: (3, 2), 1: (1, 0), 0: (1, 0)}


def test_an_exchange_compressor_starts_when_it_says():
    planner = _planner(compression=Compression.powersgd(start_iter=10))
    conv = TENSORS[0]
    assert planner.path(conv, 1.0, step=0) == PathKind.DENSE
    assert planner.path(conv, 1.0, step=10) == PathKind.EXCHANGE
    assert planner.path(TENSORS[1], 1.0, step=10) == PathKind.DENSE  # small: dense


def test_hierarchical_where_it_can_run_and_refused_where_forced_and_it_cannot():
    auto = _planner(world=8, local_size=4, density=0.001, warmup=0)
    assert hierarchical_hosts(auto.resolved, 4, 2, True, False)
    assert not hierarchical_hosts(auto.resolved, 1, 8, True, False)  # one rank per host: flat
    forced = _planner(density=0.001, warmup=0, aggregation="hierarchical")
    with pytest.raises(ValueError, match="several hosts of several ranks"):
        hierarchical_hosts(forced.resolved, 1, 8, True, False)
    with pytest.raises(ValueError, match="does not run with period=2"):
        hierarchical_hosts(_planner(density=0.001, warmup=0, aggregation="hierarchical",
                                    period=2).resolved, 4, 2, True, False)
    # what a framework cannot run yet: flat under "auto", refused with why where forced
    assert not hierarchical_hosts(auto.resolved, 4, 2, True, False,
                                  "in TensorFlow it does not yet")
    with pytest.raises(ValueError, match="in TensorFlow it does not yet. Use aggregation='auto'"):
        hierarchical_hosts(forced.resolved, 4, 2, True, False, "in TensorFlow it does not yet")
    # before the hosts are known (the wrap-time check refuses such a job): dense
    assert forced.path(TENSORS[2], 0.001) == PathKind.DENSE
    forced.replan(8, local_size=4)
    assert forced.path(TENSORS[2], 0.001) == PathKind.HIERARCHICAL


def test_tensorflow_asks_per_density_stage():
    planner = _planner(world=2, warmup=4, warmup_unit="step", density=0.001)
    assert planner.densities() == (0.25, 0.0625, 0.015625, 0.004, 0.001)
    stages = planner.stage_paths(TENSORS[2])
    assert len(stages) == 5 and stages[-1] == PathKind.ALLGATHER
    assert stages == tuple(planner.path(TENSORS[2], d) for d in planner.densities())


def test_the_words_and_the_dict_every_rank_compares():
    planner = _planner(world=2, density=0.001, warmup=0)
    line = PlanWords(planner).summary("torch", 0)
    assert line.startswith("[hvd_dgc] torch: DGC at density 0.001, no warm-up: 2 of 5")
    assert "allgather" in line and "density=1.0" in line
    assert PlanWords(planner).idle_warning(0.001) is None
    config = optimizer_consistency(planner, op="average")
    assert config["tensors"][2] == ["fc.weight", [1000, 512]]
    assert config["sparse_gradients"] == ["emb.weight"] and config["op"] == "average"
    tiny = Planner(planner.resolved, [TensorInfo(0, "b", 10, (10,))], 2)
    assert "min_compress_size=1024" in PlanWords(tiny).idle_warning(0.001)


def test_adams_freeze_waits_for_the_first_stage_that_goes_sparse():
    """plan.py adam_freeze: the default freeze (20) where the first stage goes sparse;
    later, at the start of the first stage whose sparse tensors hold a tenth of the
    gradient (ADAM_SPARSE_SHARE), where selecting records costs more than the dense
    allreduce at the early densities, and every tensor dense before it; never (exact
    Adam, every tensor dense) where no stage sends that much sparse; as planned with
    delay, or with stages in epochs (only the final density judged: sparse keeps 20,
    dense declines)."""
    from horovod.torch.mpi_ops import Adasum, Average, Sum
    from hvd_dgc.adam import ADAM_SPARSE_SHARE, sparse_share
    tensors = [TensorInfo(i, f"t{i}", n, (n,))
               for i, n in enumerate((16384, 256, 65536, 256, 2560, 10))]

    def planned(record_seconds, lagging="", **options):
        resolved = DGCConfig.from_options(
            dict(options, cost_model=CostModel(select_record_seconds=record_seconds)),
            "torch", "DistributedOptimizer").resolve(
            TORCH, Compression.dgc, HorovodArguments(Average, 1.0, 1, None,
                                                     (Average, Sum, Adasum)),
            (False, "AdamW", True))
        planner = Planner(resolved, tensors, 2)
        return planner, planner.adam_freeze(lagging)

    def freeze(record_seconds, lagging="", **options):
        planner, at = planned(record_seconds, lagging, **options)
        return at, planner.adam.declined

    # the default stages from step 20: 0.25 to 180, 0.0625 to 660, 0.0156 to 2520,
    # 0.004 to 10020, then 0.001
    assert ADAM_SPARSE_SHARE == 0.1
    assert freeze(0.0) == (20, False)
    assert freeze(1e-6) == (660, False)
    # at 1e-5 a record: from 2520 only the 2,560-element tensor goes sparse (3% of the
    # gradient), from 10020 the 16,384 and 65,536 ones too (99%): the freeze waits, and
    # until then the small one goes dense as well (Adam exact)
    planner, at = planned(1e-5)
    small, big = tensors[4], tensors[2]
    assert at == 10020 and not planner.adam.declined
    fresh = Planner(planner.resolved, tensors, 2)  # (the paths before the decision)
    assert round(sparse_share(fresh, 0.004), 3) == 0.03
    assert round(sparse_share(fresh, 0.001), 3) == 0.994
    assert planner.adam.dense == {0.25, 0.0625, 0.015625, 0.004}
    assert planner.path(small, 0.004) == PathKind.DENSE
    assert planner.path(small, 0.001) == planner.path(big, 0.001) == PathKind.ALLGATHER
    assert freeze(1e-3) == (None, True)
    # at a final 0.004 (no warm-up) only the small tensor is ever sparse: declined, and
    # it goes dense at every density; the line says why
    planner, at = planned(1e-5, density=0.004, warmup=0)
    assert at is None and planner.adam.declined and planner.adam.share == 2560 / 85002
    assert {planner.path(t, d) for t in tensors for d in (0.004, 1.0)} == {PathKind.DENSE}
    line = PlanWords(planner).summary("torch", 0)
    assert "Adam not taken over: 3.0% of the gradient would go sparse on this link " \
           "(under 10%: every tensor goes dense), so exact Adam runs throughout" in line, line
    assert PlanWords(planner).idle_warning(0.004).startswith(
        "hvd_dgc: on this link only 3.0% of the gradient would go sparse (under 10%), too "
        "little to be worth freezing Adam's variance, so every tensor goes dense")
    assert freeze(1e-3, lagging="delay=2") == (20, False)
    epochs = dict(density=0.01, warmup=3, warmup_unit="epoch", warmup_densities=(0.5,))
    assert freeze(1e-6, **epochs) == (20, False)
    assert freeze(1e-3, **epochs) == (None, True)


def test_adam_stays_exact_where_a_payload_compressor_would_send_everything_dense():
    """AdamW with bf16: taken over (frozen at 20) on 2 ranks, where bf16's allgather is
    the cheaper; exact Adam throughout on 8, where every large tensor would go dense
    anyway (nothing to gain from the frozen variance); with delay as planned (it needs
    the linear update)."""
    from horovod.torch.mpi_ops import Adasum, Average, Sum
    tensors = [TensorInfo(0, "w", 65536, (256, 256)), TensorInfo(1, "b", 256, (256,))]

    def freeze(world, lagging=""):
        resolved = DGCConfig.from_options({}, "torch", "DistributedOptimizer").resolve(
            TORCH, Compression.bf16, HorovodArguments(Average, 1.0, 1, None,
                                                      (Average, Sum, Adasum)),
            (False, "AdamW", True))
        planner = Planner(resolved, tensors, world)
        return planner.adam_freeze(lagging), planner.adam.declined

    assert freeze(2) == (20, False)
    assert freeze(8) == (None, True)
    assert freeze(8, lagging="delay=2") == (20, False)


def test_a_payload_compressors_allgather_is_priced_against_the_allreduce():
    """sign, QSGD and bf16 allgather a payload from every rank: at N ranks each receives
    N-1 of them, which outgrows the dense allreduce's 2(N-1)/N of the tensor (one bit an
    element from N = 64, QSGD's 4 bits from N = 16, bf16's 16 from N = 5, latency aside:
    with it, sign turns at 71 for this tensor). Such a tensor goes dense, what the
    compressor had kept in the memory with it; PowerSGD's allreduces are not priced."""
    from hvd_dgc.packing import qsgd_payload_bytes, sign_chunk_bytes, sign_payload_bytes
    fc = TENSORS[2]  # 512,000 elements
    model = CostModel()
    gathered = Compression.sign(collective="allgather")
    cases = [(gathered, sign_payload_bytes(fc.numel)),
             (Compression.qsgd, qsgd_payload_bytes(fc.numel, 7, 128)),
             (Compression.bf16, 2 * fc.numel)]
    for compression, payload in cases:
        last = None
        for world in (1, 2, 4, 5, 8, 16, 32, 64, 68, 128):
            planner = _planner(world=world, compression=compression)
            path = planner.path(fc, 1.0, step=100)
            # the formula, by hand: (N-1) alpha + (N-1) p beta against 2(N-1) alpha +
            # 2(N-1)/N 4n beta
            gather = (world - 1) * (model.alpha + payload / model.bandwidth)
            dense = 2 * (world - 1) * (model.alpha + 4 * fc.numel / world / model.bandwidth)
            assert path == (PathKind.EXCHANGE if gather <= dense else PathKind.DENSE), \
                (compression.name, world, path)
            assert last != PathKind.DENSE or path == PathKind.DENSE  # once dense, stays
            last = path
        assert last == PathKind.DENSE, compression.name  # every one of them, by 128 ranks
    # where each turns for this tensor on the assumed link (its latency favours the one
    # allgather a little: sign turns at 71, not 64)
    turns = {c.name: min(w for w in range(2, 200) if _planner(world=w, compression=c).path(
        fc, 1.0, step=100) == PathKind.DENSE) for c, _ in cases}
    assert turns == {"sign": 71, "qsgd": 16, "bf16": 5}, turns
    # the decision follows the world (an elastic reset), and is said; conv.weight's
    # 36,864 elements stay signed at any N: one allgather's latency against the
    # allreduce's two outweighs its bytes
    planner = _planner(world=2, compression=gathered)
    assert planner.path(fc, 1.0, step=100) == PathKind.EXCHANGE
    assert planner.exchanged.dense() == [] and PlanWords(planner).idle_warning() is None
    assert "would cost more than the allreduce" not in PlanWords(planner).summary("torch", 0)
    planner.replan(128)
    assert planner.exchanged.dense() == [fc] and PlanWords(planner).idle_warning() is None
    line = PlanWords(planner).summary("torch", 0)
    assert "compressor sign on 1 of 5 tensors" in line, line
    assert "dense where sign's allgather at 128 ranks would cost more than the allreduce: " \
        "1 of 2 large tensors" in line, line
    alone = Planner(planner.resolved, [fc], 128)  # nothing left to compress: warned
    assert "at 128 ranks every rank would receive 127 sign payloads" in \
        PlanWords(alone).idle_warning()
    # its work, measured: on a fast link sign's encoding and decoding cost more than
    # the allreduce they spare, and the words say the work counted
    from hvd_dgc.localcost import PayloadCost
    fast = _planner(world=2, compression=Compression.sign,
                    cost_model=CostModel(alpha=20e-6, bandwidth=1.25e9))
    assert fast.path(fc, 1.0, step=100) == PathKind.EXCHANGE  # the bytes alone
    fast.measured(None, PayloadCost(1e-9, 2e-9))  # 0.5 ms + 2 x 1 ms against ~1.7 ms
    assert fast.path(fc, 1.0, step=100) == PathKind.DENSE
    assert fast.cost_model.encode_element_seconds == 1e-9
    assert "dense where sign's allgather and its work at 2 ranks" in \
        PlanWords(fast).summary("torch", 0)
    # the sign by default: from 3 ranks its compressed allreduce, priced as such (2 (N-1)
    # chunks of n/8N bytes against the ring's 2(N-1)/N 4n): signed at any N, and said
    for world in (2, 3, 128, 1024):
        planner = _planner(world=world, compression=Compression.sign)
        assert planner.path(fc, 1.0, step=100) == PathKind.EXCHANGE, world
        assert planner.prices.wire_bytes(fc.numel, planner.k(fc, 1.0), PathKind.EXCHANGE) == (
            sign_payload_bytes(fc.numel) if world == 2 else
            2 * (world - 1) * sign_chunk_bytes(fc.numel, world))
    assert exchange_collective(planner) == "compressed allreduce"
    reduced = _planner(world=3, compression=Compression.sign, cost_model=CostModel(
        alpha=20e-6, bandwidth=1.25e9))
    reduced.measured(None, PayloadCost(1e-8, 2e-8))
    assert "dense where sign's compressed allreduce and its work at 3 ranks" in \
        PlanWords(reduced).summary("torch", 0)
    # PowerSGD's allreduces do not grow with N: not priced
    assert _planner(world=128, compression=Compression.powersgd(start_iter=0)).path(
        fc, 1.0, step=100) == PathKind.EXCHANGE


def test_adam_with_no_option_resolves_to_zero_one_adam_and_keeps_its_period_where_taken():
    """adam.py ZERO_ONE_PERIOD: Adam/AdamW with Horovod's compression (none, fp16, or not
    given) resolves to 0/1 Adam (the sign, period 4, exact Adam to step 20, refreshed);
    its own delay or period keep the sign at that pace (1-bit Adam), its freeze is
    honoured; an option of DGC's top-k, another compressor, no take-over or SGD keep what
    they say. The planner keeps the period where the sign
    is taken over and drops it where it is declined (encoding the sign costs more than
    the allreduce it spares), so the step is Horovod's every step."""
    from horovod.torch.mpi_ops import Adasum, Average, Sum
    from hvd_dgc.adam import ZERO_ONE_PERIOD
    from hvd_dgc.torch.quantize import SignCompressor
    args = HorovodArguments(Average, 1.0, 1, None, (Average, Sum, Adasum))
    adamw = (False, "AdamW", True)

    def resolved(compression=Compression.none, optimizer=adamw, grad_scaler=None, **options):
        return DGCConfig.from_options(options, "torch", "DistributedOptimizer").resolve(
            TORCH, compression, args, optimizer, grad_scaler=grad_scaler)

    assert ZERO_ONE_PERIOD == 4
    for compression in (Compression.none, None, "none", Compression.fp16):
        r = resolved(compression)
        assert r.zero_one and isinstance(r.compressor, SignCompressor), compression
        assert (r.config.period, r.freeze, r.refresh, r.chosen_lagging) == (4, 20, "auto", "")
        assert r.dense_fp16 == (compression is Compression.fp16)
    assert resolved(cost_model=CostModel(), clip_norm=1.0, min_compress_size=10).zero_one
    r = resolved(freeze_variance=50)
    assert r.zero_one and (r.freeze, r.refresh, r.config.period) == (50, False, 4)
    r = resolved(refresh_variance=False)
    assert r.zero_one and (r.freeze, r.refresh, r.config.period) == (200, False, 4)
    for options in ({"period": 1}, {"delay": 2}, {"delay": 0}, {"period": 2},
                    {"grad_scaler": object()}):
        r = resolved(**options)  # the sign at the script's own pace: 1-bit Adam
        assert not r.zero_one and isinstance(r.compressor, SignCompressor), options
        assert (r.config.period, r.config.delay) == (options.get("period", 1),
                                                     options.get("delay", 0)), options
        assert r.chosen_lagging == r.config.lagging, options
    for options in ({"density": 0.01}, {"warmup": 2}, {"warmup_unit": "step"},
                    {"aggregation": "allgather"}, {"compression": Compression.dgc},
                    {"freeze_variance": False}, {"optimizer": (True, "SGD")},
                    {"optimizer": (False, "RMSprop")}):
        r = resolved(**options)
        assert not r.zero_one and not isinstance(r.compressor, SignCompressor), options
        assert r.config.period == 1, options
    r = resolved(compression="sign")
    assert not r.zero_one and r.config.period == 1  # (sign asked for: every step)
    tensors = [TensorInfo(0, "w", 65536, (256, 256)), TensorInfo(1, "b", 256, (256,))]
    for model, period, declined in ((CostModel(), 4, False),
                                    (CostModel(encode_element_seconds=1e-6), 1, True)):
        planner = Planner(resolved(cost_model=model), tensors, 2)
        at = planner.adam_freeze(planner.resolved.chosen_lagging)
        settled = planner.settled()
        assert (at is None, planner.adam.declined) == (declined, declined), model
        assert settled.config.period == planner.config.period == period, model
        line = PlanWords(planner).summary("torch", 0, settled.config.period)
        assert ("0/1 Adam (Lu et al.), Adam's default where no option is given" in line) \
            == (not declined), line
    # the script's own period is never dropped (it needs the linear update: taken over)
    chosen = Planner(resolved(compression="sign", period=4,
                              cost_model=CostModel(encode_element_seconds=1e-6)), tensors, 2)
    assert chosen.adam_freeze(chosen.resolved.chosen_lagging) == 20
    assert chosen.settled().config.period == 4


def test_the_allgather_is_priced_by_the_wire_it_sends():
    """PyTorch's allgather codes its positions (about 12 bits a record at density 0.001,
    hvd_dgc/packing.py), region reduce and hierarchical DGC send int32 ones, and the
    planner prices each: a record on the allgather costs its value and
    ``index_bytes(n, k) / k``, and its value: 8 bits and a share of its tensor's
    float32 scale by default, 16 or 32 bits where asked; folded dense tensors cost their
    values alone."""
    from hvd_dgc.packing import gather_index_bytes, gather_value_bytes, index_bytes
    compressor = _planner(density=0.001, warmup=0).compressor
    n, k = 2359296, 2360  # ResNet-50's largest 3x3 convolution at 0.001
    assert gather_index_bytes(compressor, n, k) == index_bytes(n, k) / k
    assert 1.3 < gather_index_bytes(compressor, n, k) < 1.6  # 10.4-12.8 bits, not int32's 4
    assert gather_record_bytes(compressor, n, k) == 1 + 4 / k + index_bytes(n, k) / k
    for options, value in [({"value_bits": 32}, 4), ({"value_bits": 16}, 2),
                           ({"fp16_values": True, "value_bits": 32}, 2),
                           ({"fp16_values": True}, 1 + 4 / k)]:
        assert gather_value_bytes(Compression.dgc(**options), k) == value, options
    assert compressor.record_bytes == 8  # region reduce's and hierarchical DGC's records
    # a framework whose records carry int32 positions (TensorFlow's) is priced so
    int32 = type("Int32Records", (), {"value_bytes": 4, "record_bytes": 8})()
    assert gather_index_bytes(int32, n, k) == 4 and gather_record_bytes(int32, n, k) == 8


def test_the_step_chooses_between_the_allgather_and_region_reduce():
    """Region reduce carries all of a PyTorch step's tensors in one launch (its two rounds
    of latency paid once a step); the allgather pays one round per bucket. Tensor by
    tensor the allgather's one round looks cheaper at any N; for the step, from 8 ranks
    on the assumed link, region reduce is, and its bytes stay flat in N
    (bench/results/wire.md); below, the allgather's 8-bit values (region reduce sends
    them whole) and the small tensors riding it keep the allgather. The planner chooses
    for the step (``flat_at``)."""
    from harness.shapes import numel, resnet50_shapes
    tensors = [TensorInfo(i, name, numel(shape), tuple(shape))
               for i, (name, shape) in enumerate(resnet50_shapes())]
    resolved = DGCConfig(density=0.001, warmup=0, cost_model=CostModel()).resolve(
        TORCH, Compression.dgc, ARGS, (True, "SGD"))
    assert resolved.batched == {PathKind.REGION}
    chosen = {}
    for world in (2, 4, 8, 1024):
        planner = Planner(resolved, tensors, world)
        chosen[world] = {planner.path(t, 0.001) for t in tensors if planner.large(t)}
    assert chosen == {2: {PathKind.ALLGATHER}, 4: {PathKind.ALLGATHER},
                      8: {PathKind.REGION}, 1024: {PathKind.REGION}}
    model, big = CostModel(), max(tensors, key=lambda t: t.numel)
    k = num_selected(big.numel, 0.001)
    assert model.choose_aggregation(
        big.numel, k, 1024, allowed=(PathKind.ALLGATHER, PathKind.REGION),
        gather_record_bytes=gather_record_bytes(Compression.dgc, big.numel, k)) == \
        PathKind.ALLGATHER
    # where region reduce is not batched (TensorFlow's: a launch per tensor), each of its
    # tensors pays the two rounds: exactly the difference between the step's prices
    batched = Planner(resolved, tensors, 1024)
    apart = Planner(resolved._replace(batched=frozenset()), tensors, 1024)
    sparse = sum(batched.path(t, 0.001) == PathKind.REGION for t in tensors)
    assert sparse == 76
    assert apart.step_seconds(0.001, PathKind.REGION) - \
        batched.step_seconds(0.001, PathKind.REGION) == pytest.approx(
            (sparse - 1) * model.dense_preference * model.launch_seconds(PathKind.REGION, 1024))
    # a forced aggregation is not second-guessed
    forced = Planner(DGCConfig(density=0.001, warmup=0, aggregation="allgather",
                               cost_model=CostModel()).resolve(
        TORCH, Compression.dgc, ARGS, (True, "SGD")), tensors, 1024)
    assert {forced.path(t, 0.001) for t in tensors if forced.large(t)} == {PathKind.ALLGATHER}


def test_the_signs_compressed_allreduce_is_priced_as_the_group_a_step_sends():
    """AdamW's default at 1,024 ranks on ResNet-50's shapes: the sign's compressed
    allreduce carries a step's tensors together, so a tensor too small to pay alone
    (N chunks' scales and padding, two rounds of latency, all its own) joins where what
    it adds to the group costs less than its dense allreduce. Every tensor that pays
    alone is in the group; each of the others is where its marginal seconds, worked
    here from packing's sizes and the cost model's reduce_seconds, are within its
    dense seconds, and out where they are not; on 2 ranks (the sign allgathered) the
    group is what pays alone."""
    from horovod.torch.mpi_ops import Adasum, Average, Sum
    from harness.shapes import numel, resnet50_shapes
    from hvd_dgc.packing import sign_chunk_bytes
    tensors = [TensorInfo(i, name, numel(shape), shape)
               for i, (name, shape) in enumerate(resnet50_shapes())]
    resolved = DGCConfig.from_options({}, "torch", "DistributedOptimizer").resolve(
        TORCH, None, HorovodArguments(Average, 1.0, 1, None, (Average, Sum, Adasum)),
        (False, "AdamW", True))

    def plan(world):
        planner = Planner(resolved, tensors, world)
        large = [t for t in tensors if planner.large(t)]
        group = [t for t in large if planner.exchanged.path(t) == PathKind.EXCHANGE]
        alone = [t for t in large if planner.prices.exchange(t.numel) == PathKind.EXCHANGE]
        return planner.prices.cost_model, large, group, alone

    model, large, group, alone = plan(1024)
    assert set(alone) < set(group), "nothing gained from the group: the test shows nothing"
    joined = set(group) - set(alone)
    assert len(joined) == 14

    def seconds(members):
        sizes = [t.numel for t in members]
        return model.reduce_seconds(sum(sizes), sign_chunk_bytes(sizes, 1024), 1024)
    total = seconds(group)
    for t in large:
        dense = model.dense_seconds(t.numel, 1024, 4)
        if t in joined:
            marginal = total - seconds([u for u in group if u is not t])
            assert marginal * model.dense_preference <= dense, t
        elif t not in group:  # it would cost more in the group than dense
            marginal = seconds(group + [t]) - total
            assert marginal * model.dense_preference > dense, t
    _, _, group2, alone2 = plan(2)
    assert group2 == alone2
