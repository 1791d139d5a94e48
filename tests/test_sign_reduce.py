"""The sign's compressed allreduce (1-bit Adam's; hvd_dgc/torch/quantize.py) against its
NumPy reference (tests/reference.py ``sign_reduce``): a hand-derived vector, what is
conserved, the bytes on the wire, and real ranks under horovodrun at 2, 3 and 4 (uneven
chunks, empty ones), step after step with the server errors carried."""

import numpy as np
import pytest

from harness.hvdrun import run
from hvd_dgc.packing import exchange_bytes, sign_chunk_bytes, sign_reduce_bytes, sign_reduces
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
    return world, run("tests.workers.torch_sign_reduce:steps", np=world, controller="gloo")


def _reference(world):
    """The reference's run of the workers' steps: ``(step, tensor, memories, average,
    sent, server errors)`` of each exchange, every rank's memory keeping what it did not
    send."""
    errors = [None] * len(NUMELS)
    left = [[np.zeros(n, F) for n in NUMELS] for _ in range(world)]
    for step in range(STEPS):
        xs = inputs(world, step)
        for t in range(len(NUMELS)):
            memories = [left[r][t] + xs[r][t] for r in range(world)]
            average, sent, errors[t], _ = sign_reduce(memories, errors[t])
            yield step, t, memories, average, sent, errors[t]
            for r in range(world):
                left[r][t] = memories[r] - sent[r]


def test_real_ranks_equal_the_reference(ranks):
    world, results = ranks
    last = {}
    for step, t, memories, average, sent, errors in _reference(world):
        for rank, out in enumerate(results):
            got = out["steps"][step]
            np.testing.assert_array_equal(got["before"][t], memories[rank])
            np.testing.assert_array_equal(got["averages"][t], average)
            np.testing.assert_array_equal(got["residuals"][t], memories[rank] - sent[rank])
            assert got["wire"][t] == sign_reduce_bytes(NUMELS[t], world)[0]
            np.testing.assert_array_equal(got["errors"][t], errors[rank])
        last[t] = errors
    for rank, out in enumerate(results):  # the checkpoint's round trip
        for t in range(len(NUMELS)):
            np.testing.assert_array_equal(out["reloaded"][t], last[t][rank])
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
    results = run("tests.workers.torch_sign_reduce:adamw_default", np=3, controller="gloo")
    for out in results:
        assert out["compressor"] == ["SignCompressor", "auto"]
        assert out["exchanges"] == [23, 27, 31]
        # wide_mlp: 3 weights by sign at 3 exchanges, the 3 biases dense beside them
        assert out["paths"] == {"dense": 6 * 20 + 3 * 3, "sign": 3 * 3}, out["paths"]
        assert out["bytes"] == {n: sign_reduce_bytes(n, 3)[0] for n in (2560, 16384, 65536)}
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
    (period 4) allgathers it: delayed averaging's threads carry one round."""
    world = 3
    results = run("tests.workers.tf_sign_reduce:steps", np=world, controller="gloo")
    assert [out["collectives"] for out in results] == [["allgather", "auto"]] * world
    results = [out["steps"] for out in results]
    for step, t, _, average, sent, errors in _reference(world):
        for rank, out in enumerate(results):
            got = out[step]
            np.testing.assert_array_equal(got["averages"][t], average)
            np.testing.assert_array_equal(got["sent"][t], sent[rank])
            np.testing.assert_array_equal(got["errors"][t], errors[rank])
            assert got["bytes"][t] == sign_reduce_bytes(NUMELS[t], world)[0]
