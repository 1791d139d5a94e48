"""Run a Horovod (Gloo) job with one rank in each namespace of a WanLink.

horovodrun would reach remote hosts through ssh; here the two "hosts" are
namespaces on this machine, so this does what horovodrun's Gloo launcher does
(Horovod's own rendezvous server and host assignment, the same HOROVOD_*
environment per rank) with `ip netns exec` in place of ssh. The rendezvous
server runs in namespace 0, so rank 1 reaches it across the emulated link.

    with WanLink(100, 50) as link:
        outputs = run_job(link, [sys.executable, "train.py", "--steps", "20"])

As a rendezvous helper (used by run_job):
    python -m harness.launch --rendezvous HOSTS NP
"""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _serve(hosts, num_proc):
    """Horovod's rendezvous server for ``hosts``; prints its port, serves until stdin closes."""
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
    from horovod.runner.http.http_server import RendezvousServer
    server = RendezvousServer()
    port = server.start()
    server.init(get_host_assignments(parse_hosts(hosts), num_proc))
    print(port, flush=True)
    sys.stdin.read()
    server.stop()


def rank_env(link, rank, port, extra=None):
    env = dict(os.environ)
    env.update({
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": link.ip(0),
        "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_GLOO_IFACE": "wan0",
        "HOROVOD_HOSTNAME": f"host{rank}",
        "HOROVOD_RANK": str(rank), "HOROVOD_SIZE": "2",
        "HOROVOD_LOCAL_RANK": "0", "HOROVOD_LOCAL_SIZE": "1",
        "HOROVOD_CROSS_RANK": str(rank), "HOROVOD_CROSS_SIZE": "2",
        "PYTHONPATH": REPO + os.pathsep + env.get("PYTHONPATH", ""),
        "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "3",
    })
    env.update(extra or {})
    return env


def run_job(link, argv, env=None, timeout=600):
    """Run ``argv`` as rank 0 in namespace 0 and rank 1 in namespace 1.

    Returns [(returncode, stdout, stderr)] by rank; a hung job is killed at
    ``timeout`` seconds and reported with returncode None.
    """
    helper = link.popen(0, [sys.executable, "-m", "harness.launch", "--rendezvous",
                            "host0:1,host1:1", "2"], stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE, text=True, cwd=REPO,
                        env=rank_env(link, 0, 0, env))
    try:
        port = int(helper.stdout.readline())
        ranks = [link.popen(i, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO, env=rank_env(link, i, port, env)) for i in range(2)]
        results = []
        for proc in ranks:
            try:
                out, err = proc.communicate(timeout=timeout)
                results.append((proc.returncode, out, err))
            except subprocess.TimeoutExpired:
                for p in ranks:
                    p.kill()
                out, err = proc.communicate()
                results.append((None, out, err))
        return results
    finally:
        helper.stdin.close()
        try:
            helper.wait(timeout=10)
        except subprocess.TimeoutExpired:
            helper.kill()


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--rendezvous":
        _serve(sys.argv[2], int(sys.argv[3]))
    else:
        sys.exit(__doc__)
