"""The sign's compressed allreduce (1-bit Adam's; hvd_dgc/torch/quantize.py) against its
NumPy reference (tests/reference.py ``sign_reduce``): hand-derived vectors (one tensor;
a group whose chunk holds parts of two), what is conserved, the bytes on the wire, and
real ranks under horovodrun at 2, 3 and 4 (uneven chunks, empty ones, a step's tensors
in one exchange), step after step with the server errors carried."""

import numpy as np
import pytest

from harness.hvdrun import run
from hvd_dgc.aggregation import chunk_spans, slices
from hvd_dgc.packing import exchange_bytes, sign_chunk_bytes, sign_reduce_bytes, sign_reduces, \
    sign_shares
from tests.reference import SIGN_NUMELS as NUMELS, SIGN_STEPS as STEPS, sign_inputs as inputs, \
    sign_reduce

F = np.float32


def test_hand_derived_vector():
    # 2 ranks, 5 elements: chunks [0, 3) and [3, 5), rows of 3
    r0, r1 = F([1, -2, 3, -4, 5]), F([-1, -1, 1, 1, 0])
    average, sent, errors, payloads = sign_reduce([r0, r1])
    # rank 0's chunks: scale 2 (|1|+|-2|+|3| over 3) and 4.5; rank 1's: 1 and 0.5 (0 is +)
    np.testing.assert_array_equal(sent[0], F([2, -2, 2, -4.5, 4.5]))
    np.testing.assert_array_equal(sent[1], F([-1, -1, 1, 0.5, 0.5]))
    # owner 0: ([2,-2,2] + [-1,-1,1]) / 2 = [0.5,-1.5,1.5], scale 3.5/3; owner 1:
    # ([-4.5,4.5] + [0.5,0.5]) / 2 = [-2,2.5], scale 2.25
    s = F(3.5) / F(3)
    np.testing.assert_array_equal(average, F([s, -s, s, -2.25, 2.25]))
    np.testing.assert_array_equal(errors[0], F([0.5, -1.5, 1.5]) - F([s, -s, s]))
    np.testing.assert_array_equal(errors[1], F([0.25, 0.25]))
    # the wire: a float32 scale, then the signs least significant bit first, padded with 1s
    to_owners, resigned = payloads[0]
    assert bytes(to_owners[0]) == F([2]).tobytes() + bytes([0b101])
    assert bytes(to_owners[1]) == F([4.5]).tobytes() + bytes([0b110])
    assert bytes(resigned) == F([s]).tobytes() + bytes([0b101])
    assert bytes(payloads[1][1]) == F([2.25]).tobytes() + bytes([0b110])
    assert sign_chunk_bytes(5, 2) == 5 and sign_reduce_bytes(5, 2) == (10, 10)


def test_hand_derived_group():
    # 2 ranks, tensors of 2 and 3 elements one after the other: chunk 0 holds the first
    # and the start of the second (two scales), chunk 1 the rest of the second (one,
    # and a zero: every chunk as many scales as the one holding most)
    r0, r1 = [F([1, -2]), F([3, -4, 5])], [F([-1, -1]), F([1, 1, 0])]
    average, sent, errors, payloads = sign_reduce([r0, r1])
    np.testing.assert_array_equal(sent[0], F([1.5, -1.5, 3, -4.5, 4.5]))
    np.testing.assert_array_equal(sent[1], F([-1, -1, 1, 0.5, 0.5]))
    # owner 0: ([1.5,-1.5,3] + [-1,-1,1]) / 2 = [0.25,-1.25,2]: scales 0.75 and 2;
    # owner 1: ([-4.5,4.5] + [0.5,0.5]) / 2 = [-2,2.5]: scale 2.25
    np.testing.assert_array_equal(average, F([0.75, -0.75, 2, -2.25, 2.25]))
    np.testing.assert_array_equal(errors[0], F([-0.5, -0.5, 0]))
    np.testing.assert_array_equal(errors[1], F([0.25, 0.25]))
    to_owners, resigned = payloads[0]
    assert bytes(to_owners[0]) == F([1.5, 3]).tobytes() + bytes([0b101])
    assert bytes(to_owners[1]) == F([4.5, 0]).tobytes() + bytes([0b110])
    assert bytes(resigned) == F([0.75, 2]).tobytes() + bytes([0b101])
    assert chunk_spans((2, 3), 2) == (((0, 0, 2), (1, 0, 1)), ((1, 1, 3),))
    assert sign_chunk_bytes((2, 3), 2) == 9 and sign_reduce_bytes((2, 3), 2) == (18, 18)
    assert sign_shares((2, 3), 2) == [7, 11]


@pytest.mark.parametrize("world,n", [(2, 5), (3, 1001), (4, 37), (4, 2), (8, 64)])
def test_what_is_conserved(world, n):
    """Each rank's memory = what it sent + its residual; each owner's average of what was
    sent + its old server error = what it sends + its new one."""
    rng = np.random.default_rng(world * 100 + n)
    xs = [rng.standard_normal(n).astype(F) for _ in range(world)]
    old = [rng.standard_normal(len(e)).astype(F)
           for e in sign_reduce(xs)[2]]
    average, sent, errors, _ = sign_reduce(xs, old)
    total = np.sum([s.astype(np.float64) for s in sent], axis=0) / world
    np.testing.assert_allclose(average + np.concatenate(errors),
                               total + np.concatenate(old), rtol=1e-6, atol=1e-6)
    for x, s in zip(xs, sent):
        assert (np.sign(s) == np.where(x >= 0, 1, -1)).all()


def test_bytes_flat_in_n():
    """What a rank receives, against the allgather's (N-1) n/8 (ResNet-50's largest
    tensor, 2,359,296 elements)."""
    n = 2359296
    gathered = {w: (w - 1) * (n // 8 + 4) for w in (2, 8, 1024)}
    received = {w: sign_reduce_bytes(n, w)[1] for w in (2, 8, 1024)}
    assert received[2] == 2 * (n // 16 + 4) and received[2] <= gathered[2] + 8
    assert received[1024] / received[8] < 1.2  # 1.16: the 1,023 chunks' scales
    assert received[1024] < 2 * n / 8 + 2 * 4 * 1024 + 2 * 1024
    assert gathered[1024] / received[1024] > 400
    # a step's tensors in one exchange (11 of an LM's, 0.5M elements): the scales and the
    # padding once, not once a tensor: 1.29x from 8 to 1,024 ranks (1.14x of it the
    # ring's own 2 (N-1)/N), where tensor by tensor made 1.97x
    lm = (65536, 32768, 32768, 32768, 32768, 65536, 65536, 16384, 16384, 65536, 65536)
    group = {w: sign_reduce_bytes(lm, w)[1] for w in (8, 1024)}
    alone = {w: sum(sign_reduce_bytes(n, w)[1] for n in lm) for w in (8, 1024)}
    assert group[1024] / group[8] < 1.3 and alone[1024] / alone[8] > 1.9
    assert group[1024] < 2 * sum(lm) / 8 + 2 * 4 * 2 * 1024 + 2 * 1024
    assert not sign_reduces("auto", 2) and sign_reduces("auto", 3)
    assert sign_reduces("allreduce", 2) and not sign_reduces("allgather", 1024)


class _Gather:
    collective = "allgather"

    @staticmethod
    def payload_bytes(n):
        return n // 8 + 4


def test_exchange_bytes_by_collective():
    assert exchange_bytes(_Gather, 800, 4) == (104, 312)
    _Gather.collective = "auto"
    assert exchange_bytes(_Gather, 800, 4) == sign_reduce_bytes(800, 4) == (4 * 29, 6 * 29)


@pytest.fixture(scope="module", params=[2, 3, 4])
def ranks(request):
    world = request.param
    return world, run("tests.core.torch_sign_reduce:steps", np=world, controller="gloo")


def _reference(world):
    """The reference's run of the workers' steps, the tensors in one exchange a step:
    ``(step, memories, averages, sent, server errors)`` per step (each rank's, per
    tensor; the errors ``{tensor: (start, error)}`` of each owner's chunk), every rank's
    memory keeping what it did not send."""
    errors = None
    left = [[np.zeros(n, F) for n in NUMELS] for _ in range(world)]
    cuts = np.cumsum(NUMELS)[:-1]
    spans, bounds = chunk_spans(NUMELS, world), slices(sum(NUMELS), world)
    for step in range(STEPS):
        xs = inputs(world, step)
        memories = [[left[r][t] + xs[r][t] for t in range(len(NUMELS))] for r in range(world)]
        average, sent, errors, _ = sign_reduce(memories, errors)
        sent = [np.split(s, cuts) for s in sent]
        kept = []
        for c in range(world):
            pieces, at = {}, 0
            for t, lo, hi in spans[c]:
                pieces[t] = (lo, errors[c][at:at + hi - lo])
                at += hi - lo
            kept.append(pieces)
        yield step, memories, np.split(average, cuts), sent, kept
        for r in range(world):
            left[r] = [m - s for m, s in zip(memories[r], sent[r])]
    assert bounds[-1][1] == sum(NUMELS)


def _same_errors(got, expected):
    assert sorted(got) == sorted(expected)
    for t, (lo, error) in expected.items():
        assert got[t][0] == lo
        np.testing.assert_array_equal(got[t][1], error)


def test_real_ranks_equal_the_reference(ranks):
    world, results = ranks
    shares = sign_shares(NUMELS, world)
    for step, memories, average, sent, errors in _reference(world):
        for rank, out in enumerate(results):
            got = out["steps"][step]
            for t in range(len(NUMELS)):
                np.testing.assert_array_equal(got["before"][t], memories[rank][t])
                np.testing.assert_array_equal(got["averages"][t], average[t])
                np.testing.assert_array_equal(got["residuals"][t],
                                              memories[rank][t] - sent[rank][t])
            assert got["wire"] == shares
            _same_errors(got["errors"], errors[rank])
        last = errors
    for rank, out in enumerate(results):  # the checkpoint's round trip
        _same_errors(out["reloaded"], last[rank])
        assert out["other_rank"] == 0


def test_adamw_with_no_option_on_three_ranks_sends_the_compressed_allreduce():
    """AdamW with no option on 3 ranks (0/1 Adam, the sign every 4th step after the
    freeze at 20): the sign goes as the compressed allreduce, with its bytes; the ranks
    agree after flush(); a checkpoint saved between exchanges resumes to Horovod's
    rounding (its fusion may sum in another order), where one without the server errors
    goes elsewhere; a NaN under 1-bit Adam is skipped on every rank, the server errors
    left as they were; under delay=1 (1-bit Adam: no default period with a delay) the
    compressed allreduce, collected a step later, sends the same bytes and leaves the
    ranks equal."""
    from hvd_dgc.packing import sign_payload_bytes
    results = run("tests.core.torch_sign_reduce:adamw_default", np=3, controller="gloo")
    for out in results:
        assert out["compressor"] == ["SignCompressor", "auto"]
        assert out["exchanges"] == [23, 27, 31]
        # wide_mlp: 3 weights by sign at 3 exchanges, the 3 biases dense beside them
        assert out["paths"] == {"dense": 6 * 20 + 3 * 3, "sign": 3 * 3}, out["paths"]
        # the three in one exchange (parameter order), each counted at its share
        assert out["bytes"] == dict(zip((16384, 65536, 2560),
                                        sign_shares((16384, 65536, 2560), 3)))
        assert out["gathered_bytes"] == {n: sign_payload_bytes(n) for n in (2560, 16384, 65536)}
        assert out["identical"] and out["bad_identical"] and out["finite"]
        assert out["resumed"] < 1e-7 and out["no_errors"] > 1e-3, out
        # the allreduce's second compression: another run than the allgather's
        assert out["apart_from_gathered"] > 1e-3
        assert out["skipped"] == 1 and out["errors_kept"]
        delayed = out["delayed"]
        # with a delay 0/1 Adam's default period is not taken: 1-bit Adam, the sign at
        # every step from the freeze (12 steps, 3 weights)
        assert delayed["identical"] and delayed["finite"] and delayed["signs"] == 12 * 3
        assert delayed["bytes"] == out["bytes"]


def test_tensorflow_equals_the_same_reference_on_three_ranks():
    """Keras' and the tape's sign (hvd_dgc/tensorflow/quantize.py) on 3 ranks: the same
    inputs, the same NumPy reference, bit for bit, step after step. AdamW's default
    (period 4) sends it so too, on delayed averaging's threads."""
    world = 3
    results = run("tests.core.tf_sign_reduce:steps", np=world, controller="gloo")
    assert [out["collectives"] for out in results] == [["auto", "auto"]] * world
    results = [out["steps"] for out in results]
    shares = sign_shares(NUMELS, world)
    for step, _, average, sent, errors in _reference(world):
        for rank, out in enumerate(results):
            got = out[step]
            for t in range(len(NUMELS)):
                np.testing.assert_array_equal(got["averages"][t], average[t])
                np.testing.assert_array_equal(got["sent"][t], sent[rank][t])
            _same_errors(got["errors"], errors[rank])
            assert got["bytes"] == shares


def test_a_tape_step_sends_its_signs_in_one_exchange():
    """TensorFlow's synchronous step (a tape, 2 ranks, ``collective="allreduce"``): the
    two weights' signs leave in one compressed allreduce a step, equal to the NumPy
    reference of the two together, error feedback carried from step to step; the bias
    dense beside them; the bytes the group's."""
    results = run("tests.core.tf_sign_reduce:tape_group", np=2, controller="gloo")
    numels = (20000, 5000)
    cuts, errors = [numels[0]], None
    for step in range(3):
        vs = [results[r]["steps"][step]["v"] for r in range(2)]
        average, sent, errors, _ = sign_reduce(vs, errors)
        for r, out in enumerate(results):
            got = out["steps"][step]
            mine = np.split(sent[r], cuts)
            for j in range(2):
                np.testing.assert_array_equal(got["avg"][j], np.split(average, cuts)[j])
                np.testing.assert_array_equal(got["residual"][j], vs[r][j] - mine[j])
    for out in results:
        assert out["paths"] == {"exchange": 2 * 3, "dense": 3}, out["paths"]
        dense = 8 * 4 * 3  # the bias: 8 fp32 a step
        assert out["bytes"] == 3 * sign_reduce_bytes(numels, 2)[0] + dense, out["bytes"]


def test_a_delayed_tape_step_sends_its_signs_in_one_exchange():
    """``delay=1`` (TensorFlow's delayed averaging: the exchange on worker threads, 2
    ranks): each step returns this rank's own signs at once (the reference's, the memory
    keeping the rest) and, a step later, the group's reference average less them; the
    server errors carried from exchange to exchange; the bytes the group's."""
    results = run("tests.core.tf_sign_reduce:tape_group", np=2, controller="gloo",
                  kwargs={"steps": 4, "delay": 1})
    numels, cuts, errors, due = (20000, 5000), [20000], None, None
    for step in range(4):
        vs = [results[r]["steps"][step]["v"] for r in range(2)]
        average, sent, errors, _ = sign_reduce(vs, errors)
        owns = [np.split(own, cuts) for own in sent]
        for r, out in enumerate(results):
            got = out["steps"][step]
            for j in range(2):
                np.testing.assert_array_equal(got["residual"][j], vs[r][j] - owns[r][j])
                if due is None:  # nothing due yet: its own
                    np.testing.assert_array_equal(got["avg"][j], owns[r][j])
                else:
                    np.testing.assert_allclose(got["avg"][j] - owns[r][j], due[r][j],
                                               rtol=0, atol=2e-6)
        due = [[a - o for a, o in zip(np.split(average, cuts), owns[r])] for r in range(2)]
    for out in results:
        assert out["paths"] == {"exchange": 2 * 4, "dense": 4}, out["paths"]
        assert out["bytes"] == 4 * sign_reduce_bytes(numels, 2)[0] + 8 * 4 * 4, out["bytes"]


def test_keras_adamw_default_on_three_ranks_sends_the_compressed_allreduce():
    """Keras' AdamW with no option on 3 ranks (0/1 Adam: the sign every 4th step from the
    freeze at 20, on delayed averaging's threads): the sign goes as the compressed
    allreduce, its bytes those of sign_reduce_bytes; equal weights on every rank after
    the flush; it learns (tests/tensorflow/tf_adam.py ``zero_one_fit``)."""
    results = run("tests.core.tf_sign_reduce:keras_adamw_default", np=3, controller="gloo",
                  env={"TF_USE_LEGACY_KERAS": "0"})
    exchanges = len(range(23, 4 * 15, 4))  # 15 steps an epoch: a third of the training set
    small = (64 + 640 + 10) * 4  # the biases and the last kernel, dense fp32
    for out in results:
        assert out["collective"] == "auto" and out["period"] == 4, out
        assert out["step"] == 4 * 15 and out["identical"] and out["in_flight"] == 0, out
        assert out["paths"] == {"dense": 4 * 20 + 3 * exchanges, "exchange": exchanges}, out
        # the 20 exact steps, the exchanges, and one refresh of Adam's variance (every
        # tensor's, fp32)
        assert out["bytes"] == 20 * (4096 * 4 + small) + exchanges * (
            small + sign_reduce_bytes((4096,), 3)[0]) + (4096 * 4 + small), out["bytes"]
        assert out["accuracy"] > 0.9, out
