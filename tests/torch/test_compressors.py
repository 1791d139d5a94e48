"""PowerSGD, EF-SignSGD, TernGrad, QSGD and bf16 (issue 7).

Unit tests run the compressors in this process through ``LocalComm`` (a world
of one: collectives return their input); the multi-process tests run them in
hvd_dgc's optimizer on 2 real ranks under horovodrun --gloo (one launch).
"""

import math
import socket

import pytest
import torch

from hvd_dgc.packing import SCALE_BYTES, level_bits, qsgd_payload_bytes
from hvd_dgc.torch import Compression
from hvd_dgc.torch.collective import LocalComm
from tests.flatmem import Tensors
from hvd_dgc.torch.quantize import pack_planes, unpack_planes
from harness.hvdrun import run
from tests.torch.test_optimizer import _checked
from tests.torch.torch_compressors import compare_with_torch_hook

Z = 5.0  # standard deviations allowed per element in the unbiasedness tests


def _exchange(comp, residuals, keys=None, comm=None):
    """The optimizer's calls for one launch: launch, advance, collect."""
    comm = comm or LocalComm()
    keys = keys or [f"t{i}" for i in range(len(residuals))]
    ex = comp.launch(residuals, keys, "test", comm)
    comp.advance(ex)
    return comp.collect(ex), ex


# -- bit packing -----------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 7, 8, 9, 1000, 4097])
def test_sign_payload_is_one_bit_per_element_plus_scale(n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    payload = Compression.sign.encode(x)
    assert payload.dtype == torch.uint8
    assert payload.numel() == math.ceil(n / 8) + SCALE_BYTES == Compression.sign.payload_bytes(n)
    decoded = Compression.sign.decode(payload, n, torch.float32)
    assert torch.equal(decoded, torch.where(x >= 0, 1.0, -1.0) * x.abs().mean())


def test_eight_signs_per_byte():
    assert pack_planes(torch.ones(8, dtype=torch.uint8), 1).tolist() == [255]
    assert pack_planes(torch.tensor([1, 0, 0, 0, 0, 0, 0, 1], dtype=torch.uint8), 1).tolist() \
        == [129]


@pytest.mark.parametrize("width", [1, 2, 3, 4, 5, 8])
def test_bit_planes_round_trip(width):
    n = 1001
    codes = torch.randint(0, 2 ** width, (n,), generator=torch.Generator().manual_seed(width),
                          dtype=torch.int64).to(torch.uint8)
    packed = pack_planes(codes, width)
    assert packed.numel() == width * math.ceil(n / 8)
    assert torch.equal(unpack_planes(packed, width, n), codes)


def test_qsgd_payload_bytes():
    comp = Compression.qsgd(levels=7, bucket_size=512)
    x = torch.randn(1500)
    assert comp.encode(x).numel() == qsgd_payload_bytes(1500, 7, 512) == 3 * 4 + 4 * 188
    assert level_bits(7) == 3 and level_bits(15) == 4 and level_bits(1) == 1


# -- unbiasedness: the mean of many compressions is the input ----------------------------
def _assert_unbiased(samples, expected, step):
    """Each decoded element is ``step`` x (floor(r) or floor(r)+1), a Bernoulli choice:
    variance <= step^2 / 4 (the bound of both papers). The mean of K draws may then be
    off by Z * step / (2 sqrt(K)) at most, element by element."""
    k = samples.shape[0]
    tolerance = Z * step / (2 * math.sqrt(k))
    error = (samples.mean(0) - expected).abs()
    assert bool((error <= tolerance).all()), float((error / tolerance).max())
    return float((error / tolerance).max())


def test_qsgd_is_unbiased():
    comp = Compression.qsgd(levels=3, bucket_size=256, seed=1)
    x = torch.randn(700, generator=torch.Generator().manual_seed(0))
    k = 2000
    samples = torch.stack([comp.decode(comp.encode(x), x.numel(), torch.float32)
                           for _ in range(k)])
    norms = torch.stack([torch.linalg.vector_norm(b) for b in x.split(256)])
    step = (norms / 3).repeat_interleave(256)[:700]
    worst = _assert_unbiased(samples, x, step)
    assert worst > 0.05  # the draws do differ: the test is not vacuous
    assert bool((samples.std(0) > 0).any())


def test_terngrad_is_unbiased_for_the_clipped_gradient():
    comp = Compression.terngrad(seed=2)
    x = torch.randn(700, generator=torch.Generator().manual_seed(1))
    x[3] = 40.0  # an outlier: clipped at 2.5 sigma
    clipped = comp.clip(x)
    limit = 2.5 * x.std(correction=0)
    assert float(clipped[3]) == pytest.approx(float(limit))
    assert torch.equal(clipped[x.abs() < limit], x[x.abs() < limit])
    scale = float(clipped.abs().max())
    k = 2000
    samples = torch.stack([comp.ternarize(clipped, scale, 0) * scale for _ in range(k)])
    assert set(torch.unique(samples / scale).tolist()) <= {-1.0, 0.0, 1.0}
    _assert_unbiased(samples, clipped, torch.full_like(x, scale))


# -- error feedback: sent + residual = input + old residual -----------------------------
EF_COMPRESSORS = {
    "sign": Compression.sign,
    "qsgd": Compression.qsgd(levels=7, bucket_size=128),
    "terngrad": Compression.terngrad,
    "bf16": Compression.bf16,
    "powersgd": Compression.powersgd(rank=2, start_iter=0),
}


@pytest.mark.parametrize("name", sorted(EF_COMPRESSORS))
def test_error_feedback_residual_identity(name):
    comp = EF_COMPRESSORS[name]()
    gen = torch.Generator().manual_seed(3)
    shapes = [(32, 48), (16, 4, 3, 3)]
    memory = Tensors([math.prod(s) for s in shapes])
    old = [torch.randn(s, generator=gen) for s in shapes]
    for step in range(3):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        residuals = [v.view(s) for v, s in zip(memory.accumulate(grads), shapes)]
        if step == 0:
            for v, o in zip(residuals, old):
                v.add_(o)  # an old residual: input + old residual, as after earlier steps
        before = [v.clone() for v in residuals]
        averages, ex = _exchange(comp, residuals)
        for b, v, sent, avg in zip(before, residuals, ex.sent, averages):
            total = sent.view(-1) + v.reshape(-1)
            ulp = torch.finfo(torch.float32).eps * float(b.abs().max())
            assert float((total - b.reshape(-1)).abs().max()) <= 2 * ulp
            assert float(v.abs().max()) > 0 or name == "bf16"  # something stays behind
            assert torch.equal(avg, sent.view(-1))  # one rank: the average is what it sent


# -- PowerSGD equals torch's own hook -----------------------------------------------------
@pytest.fixture(scope="module")
def torch_process_group():
    import torch.distributed as dist
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("rank", [1, 2, 4])
def test_powersgd_matches_torch_powersgd_hook(torch_process_group, rank):
    """Same gradients, seed and rank, through torch's own powerSGD_hook (a one-process gloo
    group, a stand-in GradBucket) and hvd_dgc's PowerSGD: two dense steps, then PowerSGD
    with error feedback and warm start; the 1-D bias and the 4x4 matrix (not worth it)
    dense. r=1, 2: Gram-Schmidt; r=4: QR. Tolerance 1e-6 of the output's scale (float32
    sums in other orders); observed: 0, bit for bit. At 2 ranks: test_powersgd_two_ranks."""
    out = compare_with_torch_hook(LocalComm(), rank, [(64, 32), (16, 8, 3, 3), (16,), (4, 4)],
                                  ["w", "conv", "bias", "small"],
                                  dev="cuda" if torch.cuda.is_available() else "cpu")
    assert out["compressed"] == [0, 1]  # as torch decides too (else outputs would differ)
    assert out["iter"] == 6 and out["moved"] > 0.1  # residuals exist: EF is exercised
    assert out["output"] <= 1e-6 and out["residual"] <= 1e-6, out


# -- bf16 ----------------------------------------------------------------------------------
def test_bf16_round_trip():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(4)) * 1e3
    comp = Compression.bf16
    payload = comp.encode(x)
    assert payload.numel() == 2 * 1000 == comp.payload_bytes(1000)
    back = comp.decode(payload, 1000, torch.float32)
    assert torch.equal(back, x.to(torch.bfloat16).to(torch.float32))
    assert float(((back - x).abs() / x.abs()).max()) <= 2.0 ** -8  # 8-bit mantissa, rounded
    # Horovod's Compressor API, standalone: compress, (allgather), decompress
    payload, ctx = comp.compress(x.view(10, 100))
    assert torch.equal(comp.decompress(payload, ctx), back.view(10, 100))


def test_options_and_identity():
    assert Compression.powersgd(rank=4).rank == 4
    assert Compression.powersgd(rank=4) == Compression.powersgd(rank=4)
    assert Compression.qsgd(levels=15) != Compression.qsgd
    with pytest.raises(TypeError, match="no option"):
        Compression.sign(levels=3)
    with pytest.raises(ValueError, match="levels"):
        Compression.qsgd(levels=0)


# -- 2 ranks under horovodrun --gloo, in hvd_dgc's optimizer (one launch) -----------------
SCENARIOS = ["powersgd_vs_torch", "consistency", "delay_and_errors", "priced_dense",
             "convergence", "users_compressor"]
NAMES = ["powersgd", "sign", "terngrad", "qsgd", "bf16"]


@pytest.fixture(scope="module")
def two_ranks():
    return run("tests.torch.torch_compressors:suite", np=2, controller="gloo",
               kwargs={"names": SCENARIOS}, timeout=600)


def assert_users_compressor(outs):
    """A user's top-k by sorting, registered on Compression (docs/extending.md's recipe):
    the same run as Compression.topk's, bit for bit, through its own select, ranks
    identical (tests/tensorflow/test_tf.py holds TensorFlow's to it too)."""
    for out in outs:
        users, topk = out["users"], out["topk"]
        assert out["calls"] > 0, out["calls"]
        assert users["paths"]["sparse"] > 0 and users["paths"] == topk["paths"], out
        assert users["weights"] == topk["weights"]
        assert users["identical"] and topk["identical"]
        assert "sorted_topk" in out["repr"]


def test_a_users_own_compressor_follows_the_recipe(two_ranks):
    assert_users_compressor(_checked(two_ranks, "users_compressor"))


def test_powersgd_two_ranks_matches_torch_hook(two_ranks):
    """P summed and Q averaged across 2 ranks, each with its own gradients."""
    for out in _checked(two_ranks, "powersgd_vs_torch"):
        for rank in (1, 4):
            res = out[rank]
            assert res["compressed"] == [0, 1] and res["moved"] > 0.1
            assert res["output"] <= 1e-6 and res["residual"] <= 1e-6, res


def test_every_compressor_keeps_ranks_bit_identical(two_ranks):
    n = {"0.weight": 64 * 256, "2.weight": 256 * 256, "4.weight": 256 * 10}
    for out in _checked(two_ranks, "consistency"):
        for name in NAMES:
            for groups in (None, 2):
                res = out[f"{name}/{groups}"]
                assert res["identical"] == [True] * 5, (name, groups)
                assert res["moved"] > 1e-3 and res["residual"] > 0, (name, res)
                last = {k.split(".", 1)[1]: v for k, v in res["last"].items()}
                for key, numel in n.items():  # the three weights compressed, biases dense
                    path, count, nbytes = last[key]
                    assert (path, count) == (name, numel), (name, key, last[key])
                assert last["0.bias"][0] == "dense"
                expected = {"powersgd": (256 + 256) * 2 * 4,
                            "sign": 256 * 256 // 8 + 4,
                            "terngrad": 2 * 256 * 256 + 4,  # float16 carrier (no int8 allreduce)
                            "qsgd": 256 * 256 // 128 * 4 + 4 * 256 * 256 // 8,
                            "bf16": 2 * 256 * 256}[name]
                assert last["2.weight"][2] == expected, (name, last["2.weight"])


def test_delay_and_stock_optimizer_errors(two_ranks):
    for out in _checked(two_ranks, "delay_and_errors"):
        assert out["sign_delay_identical"]
        for tag in ("powersgd", "terngrad"):
            assert out[f"delay_{tag}"].startswith("delay=1 does not work with"), out
            assert "Use delay=0" in out[f"delay_{tag}"]
        for tag in NAMES:
            msg = out[f"stock_{tag}"]
            assert "cannot run inside Horovod's own DistributedOptimizer" in msg, (tag, msg)
            assert "hvd_dgc.torch.DistributedOptimizer" in msg
        assert "no bfloat16 kernel" in out["stock_bf16"]
        assert "allreduce(op=Max)" in out["stock_terngrad"]
        assert "cannot run inside" in out["allreduce_sign"]


def test_a_payload_compressor_priced_dense_trains_dense_and_loses_nothing(two_ranks):
    """ExchangeGroup (plan.py) on 2 ranks: sign whose allgather the cost model finds dearer
    than the allreduce sends every tensor dense and trains as dense averaging
    (``density=1.0``) does, bit for bit; a tensor that turns dense after signed steps
    sends sign's residual with it (the memory's v empty after that step); AdamW whose
    every tensor goes dense is not taken over (exact Adam: plan.adam_freeze)."""
    for out in _checked(two_ranks, "priced_dense"):
        assert out["paths"] == ["dense"], out["paths"]
        assert out["vs_dense"] == 0.0, out["vs_dense"]  # density=1.0's weights, bit for bit
        assert out["flip_paths"][:3] == [["dense", "sign"]] * 3, out["flip_paths"]
        assert out["flip_paths"][3:] == [["dense"]] * 2, out["flip_paths"]
        residual = out["residual"]
        assert min(residual[:3]) > 1e-4, residual  # sign keeps what it did not send
        assert residual[3:] == [0.0, 0.0], residual  # all of it left with the dense step
        assert out["flip_identical"]
        # AdamW, sign priced dense: exact Adam throughout, density=1.0's weights
        assert out["adam_sign_slow"]["adam_freeze"] is None, out["adam_sign_slow"]
        assert out["adam_vs_dense"] == 0.0, out["adam_vs_dense"]


def test_digits_each_compressor_within_two_points_of_dense(two_ranks):
    for out in _checked(two_ranks, "convergence"):
        dense = out["dense"]["accuracy"]
        print("digits accuracy:", {k: round(v["accuracy"], 4) for k, v in out.items()})
        assert dense > 0.93, "the dense baseline itself did not learn"
        for name in NAMES:
            res = out[name]
            assert res["accuracy"] >= dense - 0.02, (name, res, dense)
            assert res["identical"], name
            assert res["ratio"] > 1.5, (name, res)
