"""The dense path's shortcut in TensorFlow on 2 real ranks (tests/tensorflow/tf_settle.py):
a tensor dense at every stage sends its gradient and takes the momentum after the
average once every rank's memory of it is settled; one that goes dense later first
delivers its residual and takes the ranks' average momentum; a skipped step leaves a
settled memory as it was. Held to the maths (U_t = m U_(t-1) + G_t), step by step."""

import numpy as np
import pytest

from harness.hvdrun import run


@pytest.fixture(scope="module", params=["keras2", "keras3"])
def outs(request):
    legacy = "1" if request.param == "keras2" else "0"
    return run("tests.tensorflow.tf_settle:shortcut", np=2, timeout=600,
               env={"TF_USE_LEGACY_KERAS": legacy})


def _followed(out, momentum=0.9):
    """Per step and tensor: the applied update against U_t, and their running sums."""
    u = [np.zeros(len(m)) for m in out["means"][0]]
    total_applied, total_u, rows = [0.0 * x for x in u], [0.0 * x for x in u], []
    for applied, means in zip(out["applied"], out["means"]):
        row = []
        for j, (a, mean) in enumerate(zip(applied, means)):
            a = np.asarray(a)
            if mean is None:  # the skipped step
                row.append({"skipped": float(np.abs(a).max())})
                continue
            u[j] = momentum * u[j] + np.asarray(mean)
            total_applied[j] += a
            total_u[j] += u[j]
            row.append({"step": float(np.abs(a - u[j]).max()),
                        "sum": float(np.abs(total_applied[j] - total_u[j]).max()),
                        "scale": float(np.abs(total_u[j]).max())})
        rows.append(row)
    return rows, u


def test_a_dense_tensor_settles_and_its_steps_are_momentum_sgd(outs):
    for out in outs:
        rows, _ = _followed(out)
        first, after_relink, end = out["seen"]
        assert first == {"paths": [["sparse"], ["dense"]], "apart": [2, 0]}, first
        # b (dense at every stage) applies U_t every step, settled from its third on
        for t, row in enumerate(rows):
            if t != out["nan_at"]:
                assert row[1]["step"] < 1e-5, (t, row)
        assert end["apart"] == [0, 0]
        assert out["identical"] and out["u_identical"]


def test_a_tensor_that_goes_dense_delivers_its_residual_then_settles(outs):
    for out in outs:
        rows, u = _followed(out)
        sparse = out["sparse"]
        _, after_relink, _ = out["seen"]
        # the relink sends w dense, and every tensor's memory starts again unsettled
        assert after_relink == {"paths": [["dense"], ["dense"]], "apart": [2, 2]}
        # while sparse, part of U_t stays behind (error feedback): the sums differ
        assert rows[sparse - 1][0]["sum"] > 0.1 * rows[sparse - 1][0]["scale"]
        # the first dense step delivers all of it; each later step applies U_t itself
        for t in range(sparse, len(rows)):
            if t != out["nan_at"]:
                assert rows[t][0]["sum"] < 1e-5 * rows[t][0]["scale"], (t, rows[t])
            if t > sparse and t != out["nan_at"]:
                assert rows[t][0]["step"] < 1e-5, (t, rows[t])
        assert out["v_norm"] == [0.0, 0.0]
        # the kept momentum is the ranks' average one, the same on every rank
        for j in range(2):
            assert np.abs(np.asarray(out["u"][j]) - u[j]).max() < 1e-5


def test_a_settled_step_with_a_nan_on_one_rank_is_skipped_everywhere(outs):
    for out in outs:
        rows, _ = _followed(out)
        at = out["nan_at"]
        assert out["seen"][2]["apart"] == [0, 0]  # (settled before it: NAN_AT > 2)
        assert rows[at] == [{"skipped": 0.0}, {"skipped": 0.0}]
        assert out["stats"]["nonfinite_steps"] == 1
        assert out["stats"]["step"] == len(rows) - 1  # the skipped step is not counted
