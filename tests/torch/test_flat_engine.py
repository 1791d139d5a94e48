"""The flat engine (hvd_dgc/torch/exchange.py): DGC's local work is a fixed number of
operations per launch, whatever the number of tensors (on a GPU each operation is a
kernel launch). Counted with a TorchDispatchMode at np=1 under horovodrun; the times
are bench/step_overhead.py's."""

import pytest

from harness.hvdrun import run
from hvd_dgc.torch.memory import fused_kernel_available


@pytest.fixture(scope="module")
def counts():
    (out,) = run("tests.torch.torch_flat:counts", np=1, timeout=600)
    return out


def test_a_sparse_step_adds_no_operation_per_tensor(counts):
    stock = counts["stock"]["many"] - counts["stock"]["few"]  # the model's own, per tensor
    for tag in ("dgc", "dgc_clip_decay"):
        ours = counts[tag]["many"] - counts[tag]["few"]
        # 64 more tensors: at most the operations stock's step adds for them (the loss,
        # backward and SGD's own step), and a handful more, not a few per tensor
        assert ours <= stock + 8, (tag, counts)


def test_dense_averaging_launches_per_tensor_at_a_fixed_cost_each(counts):
    """density=1.0: each tensor leaves from its own hook, as in Horovod (its allreduce
    overlaps the rest of the backward pass), so each pays one launch's operations."""
    stock = counts["stock"]["many"] - counts["stock"]["few"]
    ours = counts["dense"]["many"] - counts["dense"]["few"]
    # without the kernel library (no compiler at install, or a GPU machine's checkout)
    # the memory's update is PyTorch's two adds and a zero where the kernel makes a call
    per_launch = 16 if fused_kernel_available() else 18
    assert ours - stock <= 64 * per_launch, counts


def test_where_nothing_is_compressed_a_step_is_stock_horovods(counts):
    """Plain SGD, every tensor dense, nothing of DGC's pending: the gradients go as stock
    Horovod sends them (paths.py ``InPlacePath.takes``): per launch one operation more than
    stock's (the guard's look at the averages), no pass over the memory, no copy."""
    stock = counts["plain_stock"]["many"] - counts["plain_stock"]["few"]
    ours = counts["plain_dense"]["many"] - counts["plain_dense"]["few"]
    assert ours - stock <= 64 * (1 if fused_kernel_available() else 2), counts
    assert counts["plain_dense"]["few"] - counts["plain_stock"]["few"] <= 16 * 2 + 4, counts


def test_resnet50_step_is_within_100_operations_of_stock(counts):
    res = counts["resnet50"]
    assert res["dgc"] - res["stock"] <= 100, res


def test_a_checkpoint_from_before_the_flat_engine_loads_and_trains_on():
    """tests/data/checkpoint_before_flat_engine.pt was written by the release before the
    flat engine (commit 915821a; per-parameter memory, the DGC sampler's generator):
    every parameter's residual and velocity come back exactly, and training goes on."""
    import os
    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data",
                        "checkpoint_before_flat_engine.pt")
    (out,) = run("tests.torch.torch_flat:old_checkpoint", np=1, kwargs={"path": path})
    assert out["saved_residual"] > 0.1, "nothing was saved: the test would prove nothing"
    assert out["same"] and all(out["same"].values()), out["same"]
    assert out["step"] == 6 and out["warnings"] == []
    assert out["moved"] > 0 and out["finite"]


def test_writing_into_the_gradients_is_the_flat_buffer_bit_for_bit():
    for out in run("tests.torch.torch_flat:update_targets", np=2):
        assert out["moved"] > 1e-3
        assert out["paths"].get("sparse") and out["paths"].get("dense"), out["paths"]
        assert all(out["equal"]) and len(out["equal"]) == 8, out["equal"]


def test_a_channels_last_model_trains_as_row_major_with_its_own_strides():
    for out in run("tests.torch.torch_flat:channels_last", np=2):
        # the gradients handed back keep the weights' strides (no per-tensor copies or
        # adds in torch's foreach kernels); DGC at density 1.0 is the row-major model's
        # training bit for bit, and Horovod's
        assert out["grad_strides"] and all(g == p for g, p in out["grad_strides"]), out
        assert any(p[1] == 1 for _, p in out["grad_strides"])  # really channels_last
        assert all(out["same_as_row_major"]) and len(out["same_as_row_major"]) == 6
        assert out["vs_horovod"] < 1e-6, out["vs_horovod"]
        assert out["adam_phase"] == "frozen variance" and out["adam_refreshes"] >= 1, out
        assert out["adam_same_as_row_major"], out["adam_diff"]
        assert out["delay_same_as_row_major"], out["delay_diff"]
        # the residual a checkpoint holds reads in row-major order (the memory's own
        # order read that way is a shuffle)
        assert out["residual_matches"] and not out["raw_read_row_major_matches"], out
        assert out["resumed_equal"] and out["portable"] and out["moved"] > 1e-3, out


def test_a_view_update_clears_only_what_it_does_not_rewrite():
    """ViewUpdate (update.py): the buffer the gradients view is zero but where the last
    update wrote. A range assigned whole this time is not cleared first (a dense path's
    range: a pass over it for nothing); the last records' positions inside it are; what
    is neither assigned nor added this time is cleared once every path has written."""
    import types

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from hvd_dgc.torch.update import ViewUpdate

    class Clears(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name in ("zero_", "fill_", "index_fill_"):
                self.ops.append((name, args[0].numel()))
            return func(*args, **(kwargs or {}))

    buffer = torch.full((128,), 7.0)  # never written: anything
    layout = types.SimpleNamespace(update=buffer, written=None, g=buffer)

    def update(assigns, adds):
        out, seen = ViewUpdate(layout), Clears()
        with seen:
            for lo, hi, value in assigns:
                out.assign(lo, hi, torch.full((hi - lo,), value))
            for positions, values in adds:
                out.add(torch.tensor(positions), torch.tensor(values))
            out.finish()
        return buffer, seen.ops

    # unknown before: all but the assigned range cleared, once (records added after)
    got, ops = update([(0, 32, 1.0)], [([40, 100], [2.0, 3.0])])
    want = torch.zeros(128)
    want[:32], want[40], want[100] = 1.0, 2.0, 3.0
    assert torch.equal(got, want) and ops == [("zero_", 96)], ops
    # [32, 64) assigned over the record at 40: the last records' positions cleared first
    # (one call), then [0, 32) (assigned last time, not now), nothing else
    got, ops = update([(32, 64, 5.0)], [])
    want = torch.zeros(128)
    want[32:64] = 5.0
    assert torch.equal(got, want), got
    assert ops == [("index_fill_", 128), ("zero_", 32)], ops
    # the same dense range again: nothing cleared at all
    got, ops = update([(32, 64, 6.0)], [])
    want[32:64] = 6.0
    assert torch.equal(got, want) and ops == [], ops
    # records where the dense range was: that range cleared before they are added
    got, ops = update([], [([50], [4.0])])
    want = torch.zeros(128)
    want[50] = 4.0
    assert torch.equal(got, want) and ops == [("zero_", 32)], ops
