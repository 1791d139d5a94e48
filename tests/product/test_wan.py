"""The WAN emulator (harness/wan.py): the link has the rate and delay asked, it cleans up
after itself, and a real 2-rank Horovod job runs across it.

Speed-ups are the benchmark's business (bench/wan_throughput.py), not a test's.
Needs root and /dev/net/tun (CI has both); elsewhere these tests say why they skip.
"""

import json
import os
import subprocess
import sys

import pytest

from harness.hvdrun import REPO

sys.path.insert(0, REPO)
from harness.wan import WanLink, available  # noqa: E402

OK, WHY = available()
pytestmark = pytest.mark.skipif(not OK, reason=f"WAN emulator unavailable here: {WHY}")


def namespaces():
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


@pytest.mark.parametrize("rate_mbit,rtt_ms", [(10, 50), (100, 200)])
def test_link_has_the_rate_and_round_trip_asked_within_10_percent(rate_mbit, rtt_ms):
    from harness.wan_check import check
    ok, report = check(rate_mbit, rtt_ms, tolerance=0.10)
    assert ok, report
    assert abs(report["rtt_error"]) <= 0.10 and abs(report["rate_error"]) <= 0.10, report


def test_link_removes_what_it_made_even_on_error():
    with pytest.raises(RuntimeError, match="boom"):
        with WanLink(rate_mbit=50, rtt_ms=10) as link:
            made = list(link.namespaces)
            assert all(ns in namespaces() for ns in made)
            assert os.path.exists(f"/etc/netns/{made[0]}/hosts")
            raise RuntimeError("boom")
    assert not any(ns in namespaces() for ns in made)
    assert not any(os.path.exists(f"/etc/netns/{ns}") for ns in made)


def test_link_removed_when_its_process_is_killed():
    code = ("import sys, time; sys.path.insert(0, %r)\n"
            "from harness.wan import WanLink\n"
            "with WanLink(rate_mbit=50, rtt_ms=10) as link:\n"
            "    print(' '.join(link.namespaces), flush=True); time.sleep(60)\n" % REPO)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    made = proc.stdout.readline().split()
    assert len(made) == 2 and all(ns in namespaces() for ns in made)
    proc.terminate()  # SIGTERM: the handler tears the link down
    proc.wait(timeout=30)
    assert not any(ns in namespaces() for ns in made)


@pytest.mark.parametrize("method", ["dense", "dgc"])
def test_two_rank_horovod_job_runs_across_the_link(method):
    from harness.launch import run_job
    argv = [sys.executable, os.path.join(REPO, "bench", "wan", "train_worker.py"),
            "--method", method, "--steps", "3", "--warmup-steps", "1", "--width", "256"]
    with WanLink(rate_mbit=100, rtt_ms=20) as link:
        results = run_job(link, argv, timeout=300)
    assert [code for code, _, _ in results] == [0, 0], results
    out = json.loads(results[0][1].strip().splitlines()[-1])
    assert out["method"] == method and out["workers"] == 2 and out["steps"] == 3
    assert out["samples_per_s"] > 0 and out["loss"] == out["loss"]  # finite, not NaN
    # every step waited on the link: 4 steps cannot finish within 2 round trips
    assert out["seconds"] > 2 * 0.020
