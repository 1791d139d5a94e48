"""hvd_dgc on CUDA tensors with Horovod's NCCL operations (issue 19), at np=1 and np=2 on
one GPU (two ranks share it; tests/device.py says how).

Needs a GPU and Horovod built with NCCL (tools/build_horovod_gpu.sh); CI has neither, so
there these tests are skipped, and tools/test_gpu.sh runs them with the rest of the torch
suite on CUDA tensors (HVD_DGC_TEST_DEVICE=cuda).
"""

import pytest
import torch

from harness.hvdrun import run
from tests.torch.test_optimizer import _checked


def _nccl_horovod():
    if not torch.cuda.is_available():
        return False
    try:
        import horovod.torch as hvd
    except ImportError:
        return False
    return bool(hvd.nccl_built())


pytestmark = pytest.mark.skipif(
    not _nccl_horovod(), reason="needs a CUDA GPU and Horovod built with NCCL "
                                "(tools/build_horovod_gpu.sh)")

CUDA = {"HVD_DGC_TEST_DEVICE": "cuda"}
SCENARIOS = ["syncs_per_step", "fixed_selection", "graphed_selection", "loss_scale_and_guard",
             "trial_syncs"]


@pytest.fixture(scope="module", params=[1, 2], ids=["np1", "np2"])
def cuda_run(request):
    return run("tests.torch.torch_cuda:suite", np=request.param, env=CUDA, timeout=600,
               kwargs={"names": SCENARIOS})


# Configurations whose step needs no host synchronisation at all, and those allowed one:
# the step-wide check of the averaged update (skip_nonfinite, the default) reads back one
# flag per step, not one per tensor.
SYNC_FREE = ["dgc_no_guard", "dga_delay2_no_guard", "dense_no_guard"]
ONE_PER_STEP = ["dgc", "dgc_fp16_values", "topk", "randomk", "dense"]


def test_dgc_step_reads_back_at_most_once(cuda_run):
    """Synchronisations that hvd_dgc's code leads to (the innermost hvd_dgc frame names
    them; torch_cuda._count_syncs), per training step."""
    for out in _checked(cuda_run, "syncs_per_step"):
        for tag in SYNC_FREE:
            assert out[tag]["ours"] == [0] * 4, (tag, out[tag])
        for tag in ONE_PER_STEP:
            assert out[tag]["ours"] == [1] * 4, (tag, out[tag])
        for tag, res in out.items():
            assert res["finite"], tag


def test_fixed_size_selection_is_exact_topk_when_enough_pass(cuda_run):
    for cases in _checked(cuda_run, "fixed_selection"):
        assert len(cases) == 27 + 12  # trial 3: 3 groups of 4 tensors
        dense_cases = [c for c in cases if c["trial"] != 2]
        for c in cases:
            assert c["syncs"] == 0, c
            assert c["records"] == c["k"], c
            assert c["distinct"] == c["real"] and c["values_match"] and c["pads_repeat_sent"], c
            assert c["in_exact"] == c["real"], c  # every value sent is one of the top k
            if c["trial"] == 2:  # few non-zeros (~0.3 k): every one of them goes
                assert c["real"] == min(c["nonzero"], c["k"]), c
            else:
                assert c["real"] >= 0.8 * c["k"], c
        # The threshold aims at 2k: fewer than k pass in ~0.3% of draws.
        assert sum(c["real"] for c in dense_cases) >= 0.99 * sum(c["k"] for c in dense_cases)


def test_graphed_selection_replays_the_eager_records(cuda_run):
    for out in _checked(cuda_run, "graphed_selection"):
        assert out["graphs"] >= 1, out  # captured, not fallen back to kernel by kernel
        assert len(out["steps"]) == 4
        for s in out["steps"]:
            assert s["indices"] and s["values"], out
            assert s["syncs"] == 0, out
        assert out["earlier_unchanged"], out
        # a launch's selection from its buffer (select_span): the same records, positions
        # in the buffer; captured at its second step, replayed without building the views
        # from the third
        assert len(out["span"]) == 5
        for step, s in enumerate(out["span"]):
            assert s["indices"] and s["values"], out["span"]
            assert s["fast"] == (1 if step >= 1 else 0), out["span"]  # captured at its 2nd
            assert step < 2 or s["syncs"] == 0, out["span"]
        assert out["span_earlier_unchanged"], out


def test_grad_scaler_overflow_skips_everywhere_without_per_tensor_reads(cuda_run):
    for out in _checked(cuda_run, "loss_scale_and_guard"):
        assert out["overflow_steps"] == 1
        assert out["changed"][3] == 0.0 and min(out["changed"][:3] + out["changed"][4:]) > 0
        assert out["memory_finite"]
        # GradScaler itself reads back (unscale_'s found_inf, update); hvd_dgc adds one
        # read per step, not one per tensor (5 tensors here), and on the step that is
        # skipped (the 4th) one more, that names the tensors that were not finite.
        ours = [[w for w in seen if w.startswith("torch/")] for seen in out["syncs"]]
        assert [len(w) for w in ours] == [1, 1, 1, 2, 1, 1], ours


def test_the_backward_profile_adds_no_host_reads_and_no_trial_where_launches_wait(cuda_run):
    """The measured cost model's profile of the backward pass (hvd_dgc/overlap.py) on CUDA
    tensors, set up as the CPU test of the trial (tests/core/test_linkprobe.py), where the
    timeline's plan sends the last layer's weight dense, hidden by the backward pass. On a
    GPU every launch waits for synchronize (one launch of all tensors: the scheduler's
    ``batch_all``), so the backward pass hides no transfer, the timeline's plan is the
    sums' and there is nothing to try: no trial, no switch of paths. The profile and its
    agreement (host clocks, a CPU tensor) add no host read: every step reads back once
    (the non-finite check); the ranks' weights stay bit-identical. A world of one has no
    link to profile."""
    outs = _checked(cuda_run, "trial_syncs")
    for out in outs:
        assert out["ours"] == [1] * 22, (out["ours"], out["where"])
        assert out["finite"] and out["identical"], out
        assert out["timeline"] == [False] * 22, out["timeline"]
    first = outs[0]
    if len(outs) == 1:
        assert not first["profiled"] and first["trial"] is None, first
        return
    assert outs[1]["trial"] == first["trial"]
    assert first["profiled"] and first["flat"] and first["at_end"] == first["flat"], first
    assert not first["differs"] and first["trial"]["from"] is None, first
