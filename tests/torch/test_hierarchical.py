"""Hierarchical DGC (hvd_dgc/torch/paths.py HierarchicalPath) on real Horovod ranks that
Horovod places on two hosts: ``horovodrun -H localhost:L,127.0.0.1:L --gloo`` gives
local_size L and cross_size 2 on one machine, no ssh (issue 16). N = 4 (2 x 2) for
everything, N = 8 (2 x 4) for the equivalences."""

import pytest

from harness.hvdrun import launch, run
from tests.torch.test_optimizer import _checked

WORKER = "tests.torch.torch_hierarchical:suite"
ALL = ["topology", "density_one", "sparse_steps", "conservation", "nonfinite_skip",
       "auto_choice", "delayed", "checkpoint_resume", "bad_inputs"]


def _on_two_hosts(per_host, names, timeout=600):
    np = 2 * per_host
    job = launch(WORKER, np, "gloo", {"names": names}, timeout, launcher_args=[
        "-np", str(np), "-H", f"localhost:{per_host},127.0.0.1:{per_host}", "--gloo"])
    missing = [r for r in range(np) if r not in job.results]
    if job.returncode != 0 or missing:
        raise RuntimeError(f"hierarchical run (2 x {per_host}) failed, ranks {missing} wrote "
                           f"no result:\n{job.output()}")
    return [job.results[r] for r in range(np)]


@pytest.fixture(scope="module")
def two_by_two():
    return _on_two_hosts(2, ALL)


@pytest.fixture(scope="module")
def two_by_four():
    return _on_two_hosts(4, ["topology", "density_one", "sparse_steps"], timeout=900)


@pytest.fixture(scope="module")
def one_host():
    job = launch(WORKER, 2, "gloo", {"names": ["topology", "bad_inputs"]}, 300)
    assert job.returncode == 0, job.output()
    return [job.results[r] for r in range(2)]


def _topology_is(results, per_host):
    for rank, topo in enumerate(_checked(results, "topology")):
        assert (topo["local_size"], topo["cross_size"]) == (per_host, 2), topo
        assert topo["cross_rank"] == rank // per_host, topo


@pytest.mark.parametrize("per_host", [2, 4])
def test_density_one_hierarchical_equals_flat_and_dense_horovod(per_host, two_by_two,
                                                                two_by_four):
    results = two_by_two if per_host == 2 else two_by_four
    _topology_is(results, per_host)
    for out in _checked(results, "density_one"):
        assert out["moved"] > 1e-2, "the reference did not train: comparison is empty"
        assert out["hierarchical_vs_dense"] < 1e-6 and out["hierarchical_vs_flat"] < 1e-6, out
        assert all(out["identical"]) and len(out["identical"]) == 8
        assert out["stats"]["paths"] == {"hierarchical": 6 * 8}  # every tensor, every step


@pytest.mark.parametrize("per_host", [2, 4])
def test_sparse_ranks_bit_identical_and_a_host_sends_one_local_size_th(per_host, two_by_two,
                                                                       two_by_four):
    """0.1%: every rank holds the same weights after every step; the records a host
    sends across are at most 1/local_size of flat DGC's (plus the per-slice rounding up)."""
    results = two_by_two if per_host == 2 else two_by_four
    for out in _checked(results, "sparse_steps"):
        for method, path in (("hierarchical", "hierarchical"), ("allgather", "sparse")):
            res = out[method]
            assert all(res["identical"]) and len(res["identical"]) == 10, method
            assert res["moved"] > 1e-3
            assert res["stats"]["paths"] == {path: 30, "dense": 30}, res["stats"]
        # the 3 weights: k = 17, 66, 3; each of L slices rounds its share up (<= L records)
        slack = 3 * per_host
        assert out["hierarchical"]["host_records"] <= \
            out["allgather"]["host_records"] / per_host + slack, out
        assert out["hierarchical"]["host_records"] < out["allgather"]["host_records"] / 1.5


def test_error_feedback_with_slice_owned_residuals_conserves_everything(two_by_two):
    """sum over ranks of (residual after - before - gradient) + N x update == 0: what a
    host did not send stays in the memory of the rank owning that slice."""
    for out in _checked(two_by_two, "conservation"):
        assert max(out["errors"]) <= 1e-6 * out["scale"], out["errors"]
        assert out["stats"]["paths"].get("hierarchical") == 18, out["stats"]["paths"]


def test_nonfinite_on_one_rank_skips_the_step_on_every_host(two_by_two):
    for rank, out in enumerate(_checked(two_by_two, "nonfinite_skip")):
        assert out["weights_kept"] and out["memory_kept"], out
        assert out["nonfinite_steps"] == 1 and out["identical"], out
        # every rank skips the step; rank 0 alone says so (hvd_dgc/say.py)
        assert out["warned"] == (rank == 0), (rank, out["warned"])


def test_auto_chooses_hierarchical_per_tensor_by_the_cost_model(two_by_two):
    for out in _checked(two_by_two, "auto_choice"):
        # 2 steps: the 65,536-element weight hierarchical (231 us against the coded
        # allgather's 237), the 16,384- and 2,560-element ones by allgather (173 us
        # against 176; 154 against 159)
        for tag in ("auto", "auto_delay"):
            assert out[tag] == {"hierarchical": 2, "sparse": 4, "dense": 6}, (tag, out[tag])
        for tag in ("auto_1gbit", "flat"):
            assert out[tag] == {"sparse": 6, "dense": 6}, (tag, out[tag])


def test_delayed_averaging_over_hierarchical_dgc_flushes_to_identical_ranks(two_by_two):
    for out in _checked(two_by_two, "delayed"):
        for tag in ("sparse", "dense"):
            res = out[tag]
            assert res["in_flight"] == 2 and res["identical"] and res["moved"] > 1e-3, res
            assert res["paths"] == {"hierarchical": 6 * 6}, res


def test_checkpoint_of_slice_residuals_resumes_bit_identically(two_by_two):
    for out in _checked(two_by_two, "checkpoint_resume"):
        assert out["saved_residual"] > 1.0, "no residual to lose: the test would prove nothing"
        assert out["max_diff_with_state"] == 0.0, out
        assert out["max_diff_without_state"] > 1e-4, out  # control: the residual mattered
        assert out["identical"]


def test_forced_hierarchical_that_cannot_run_says_why(two_by_two, one_host):
    dense = _checked(two_by_two, "bad_inputs")[0]["dense_compressor"]
    assert "not a sparse compressor" in dense and "aggregation='auto'" in dense, dense
    single = _checked(one_host, "bad_inputs")[0]["single_host"]
    assert "several hosts of several ranks" in single and "local_size=2" in single, single


# -- over real ssh: emulated hosts (harness/hosts.py), Gloo and MPI -------------------------
def _on_emulated_hosts(controller, names):
    """The worker on 2 emulated hosts x 2 ranks, horovodrun over ssh (mpirun's own
    topology detection, by host name, decides local_size under MPI)."""
    from harness.hosts import EmulatedHosts, available
    ok, why = available()
    if not ok:
        pytest.skip(f"emulated hosts unavailable here: {why}")
    with EmulatedHosts(["h1:2", "h2:2"], rate_mbit=1000, rtt_ms=1) as hosts:
        return run(WORKER, np=4, controller=controller, kwargs={"names": names},
                   timeout=600, hosts=hosts)


@pytest.fixture(scope="module", params=["gloo", "mpi"])
def over_ssh(request):
    return request.param, _on_emulated_hosts(request.param,
                                             ["topology", "density_one", "sparse_steps"])


def test_hierarchical_dgc_over_ssh_on_emulated_hosts(over_ssh):
    """horovodrun -np 4 -H h1:2,h2:2 over real ssh into two network namespaces (Gloo,
    and Open MPI whose own node detection gives local_size 2): the equivalence with
    dense Horovod and bit-identical ranks hold there too."""
    controller, results = over_ssh
    _topology_is(results, 2)
    for out in _checked(results, "density_one"):
        assert out["hierarchical_vs_dense"] < 1e-6 and out["hierarchical_vs_flat"] < 1e-6, \
            (controller, out)
        assert all(out["identical"]), controller
    for out in _checked(results, "sparse_steps"):
        assert all(out["hierarchical"]["identical"]), controller
        assert out["hierarchical"]["host_records"] <= \
            out["allgather"]["host_records"] / 2 + 6
