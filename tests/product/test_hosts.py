"""Emulated hosts (harness/hosts.py): Horovod's own horovodrun reaches them over real
ssh, ranks land on the host they were given, traffic between hosts crosses the
emulated link, and nothing is left behind.

Needs root and /dev/net/tun (CI has both); elsewhere these tests say why they skip.
openssh-server is not a reason to skip: tools/install.sh installs it, and without
it the tests fail with the error that says so.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext

import pytest

from harness.hvdrun import REPO, worker_env

sys.path.insert(0, REPO)
from harness.hosts import MAX_HOSTS, EmulatedHosts, HostsError, available  # noqa: E402

OK, WHY = available()
pytestmark = pytest.mark.skipif(not OK, reason=f"emulated hosts unavailable here: {WHY}")

WORKER = os.path.join(REPO, "tests", "product", "hosts_check.py")
RATE_MBIT, RTT_MS = 8, 20


def live_sshd():
    """pids of sshd processes that are not zombies (a killed child awaits its reaper)."""
    pids = set()
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name, state = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2]
        if name == "sshd" and state != "Z":
            pids.add(int(pid))
    return pids


def machine_state():
    return {
        "netns": subprocess.run(["ip", "netns", "list"], capture_output=True,
                                text=True).stdout.split("\n"),
        "links": sorted(line.split(":")[1].strip() for line in subprocess.run(
            ["ip", "-o", "link"], capture_output=True, text=True).stdout.splitlines()),
        "etc_hosts": open("/etc/hosts").read(),
        "sshd": live_sshd(),
    }


def assert_all_gone(before, hosts):
    """Nothing of ``hosts`` left: namespaces, TUN/veth, sshd, /etc files, keys."""
    for _ in range(50):  # SIGKILLed processes take a moment to stop
        after = machine_state()
        if after["sshd"] <= before["sshd"]:
            break
        time.sleep(0.1)
    listed = "\n".join(after["netns"])
    assert not any(ns in listed for ns in hosts.namespaces.values()), listed
    assert after["links"] == before["links"]  # in the machine's own namespace
    assert after["etc_hosts"] == before["etc_hosts"]
    assert after["sshd"] <= before["sshd"], after["sshd"] - before["sshd"]
    assert not any(os.path.exists(f"/etc/netns/{ns}") for ns in hosts.namespaces.values())
    assert hosts.tmpdir and not os.path.exists(hosts.tmpdir)


@pytest.fixture(scope="module")
def hosts():
    with EmulatedHosts(["h1:2", "h2:2"], rate_mbit=RATE_MBIT, rtt_ms=RTT_MS) as h:
        yield h


def run_check(hosts, controller):
    outdir = tempfile.mkdtemp(prefix="hvd_dgc_hosts_")
    try:
        done = hosts.horovodrun(["-np", "4", "-H", "h1:2,h2:2", f"--{controller}",
                                 "python", WORKER, outdir], env=worker_env(), cwd=REPO,
                                timeout=300)
        assert done.returncode == 0, f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
        reports = {}
        for name in os.listdir(outdir):
            with open(os.path.join(outdir, name)) as f:
                report = json.load(f)
            reports[report["rank"]] = report
        assert sorted(reports) == [0, 1, 2, 3], done.stdout[-4000:] + done.stderr[-4000:]
        return reports
    finally:
        shutil.rmtree(outdir, ignore_errors=True)


def check_topology(hosts, reports, controller):
    inode = {n: os.stat(f"/var/run/netns/{hosts.namespace(n)}").st_ino for n in hosts.names}
    assert inode["h1"] != inode["h2"]
    for rank, r in reports.items():
        host = "h1" if rank < 2 else "h2"
        assert r["netns_inode"] == inode[host], (rank, r)
        assert r["netns"] == hosts.namespace(host) and r["hostname"] == host, (rank, r)
        assert (r["size"], r["local_size"], r["cross_size"]) == (4, 2, 2), r
        assert r["local_rank"] == rank % 2 and r["cross_rank"] == rank // 2, r
        assert r["allreduce"] == [10.0] * 4, r  # 1+2+3+4, exactly
        assert r["controller"] == controller, r


def test_horovodrun_gloo_places_two_ranks_on_each_emulated_host(hosts):
    check_topology(hosts, run_check(hosts, "gloo"), "gloo")


def test_horovodrun_mpi_places_two_ranks_on_each_emulated_host(hosts):
    # mpirun gets the same ssh options from horovodrun (-mca plm_rsh_args "-p .. -i ..")
    check_topology(hosts, run_check(hosts, "mpi"), "mpi")


SINK = r'''
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); n = 0
while True:
    data = c.recv(1 << 20)
    if not data: break
    n += len(data)
c.sendall(b"%d" % n); c.close()
'''

SEND = r'''
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
t = time.monotonic(); c.sendall(b"\0" * int(sys.argv[3])); c.shutdown(socket.SHUT_WR)
got = int(c.recv(64)); print(time.monotonic() - t, got)
'''


def transfer(hosts, src, dst, nbytes, port):
    sink = hosts.popen(dst, [sys.executable, "-c", SINK, str(port)], stdout=subprocess.PIPE,
                       text=True)
    try:
        assert sink.stdout.readline().strip() == "ready"
        out = hosts.run(src, [sys.executable, "-c", SEND, hosts.ip(dst), str(port), str(nbytes)],
                        capture_output=True, text=True, timeout=60, check=True).stdout.split()
        assert int(out[1]) == nbytes
        return float(out[0])
    finally:
        sink.wait(timeout=10)


def test_traffic_between_hosts_takes_the_link_rate_and_inside_a_host_does_not(hosts):
    nbytes = 1_000_000  # 1 s at 8 Mbit/s
    across = transfer(hosts, "h1", "h2", nbytes, 9801)
    assert 0.7 <= across <= 10.0, across
    inside = transfer(hosts, "h1", "h1", nbytes, 9802)  # same namespace: no bottleneck
    assert inside < 0.5, inside


@pytest.mark.parametrize("how", ["normal exit", "exception"])
def test_everything_is_removed_when_the_context_exits(how):
    before = machine_state()
    h = EmulatedHosts(["a1", "a2"], rate_mbit=50, rtt_ms=10)
    with pytest.raises(RuntimeError, match="boom") if how == "exception" else nullcontext():
        with h:
            listed = subprocess.run(["ip", "netns", "list"], capture_output=True,
                                    text=True).stdout
            assert all(ns in listed for ns in h.namespaces.values())
            assert h.run("a1", ["ssh", "a2", "hostname"], capture_output=True,
                         text=True).stdout.strip() == "a2"
            assert h.sshd_pid("a1") in live_sshd()
            if how == "exception":
                raise RuntimeError("boom")
    assert_all_gone(before, h)


def test_everything_is_removed_when_the_process_gets_sigterm():
    before = machine_state()
    proc = subprocess.Popen([sys.executable, "-m", "harness.hosts", "up", "--hosts", "b1,b2"],
                            cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "ready" in line:
            break
    namespaces = [w.strip("(),") for w in lines[0].split() if w.startswith("hvddgc")]
    assert len(namespaces) == 2, (lines, proc.stderr.read() if proc.poll() is not None else "")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    fake = type("H", (), {"namespaces": dict(enumerate(namespaces)), "tmpdir": "/nonexistent"})
    assert_all_gone(before, fake)


def test_everything_is_removed_at_interpreter_exit_without_close():
    before = machine_state()
    code = ("import sys; sys.path.insert(0, %r)\n"
            "from harness.hosts import EmulatedHosts\n"
            "h = EmulatedHosts(['f1', 'f2']).__enter__()\n"
            "print(' '.join(h.namespaces.values()), h.tmpdir, flush=True)\n" % REPO)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    *namespaces, tmpdir = done.stdout.split()
    fake = type("H", (), {"namespaces": dict(enumerate(namespaces)), "tmpdir": tmpdir})
    assert_all_gone(before, fake)


def test_three_hosts_reach_each_other_over_the_mesh():
    # More than two namespaces: the forwarder routes by destination address.
    with EmulatedHosts(["g1", "g2", "g3"], rtt_ms=10) as h:
        for src, dst in (("g1", "g2"), ("g2", "g3"), ("g3", "g1")):
            done = h.run(src, ["ssh", dst, "hostname"], capture_output=True, text=True,
                         timeout=60)
            assert done.stdout.strip() == dst, (src, dst, done.stderr)


def test_one_command_sets_up_runs_horovodrun_and_tears_down():
    before = machine_state()
    done = subprocess.run([sys.executable, "-m", "harness.hosts", "run", "--hosts", "c1:1,c2:1",
                           "--rtt-ms", "10", "--", "--gloo", "hostname"], cwd=REPO,
                          env=worker_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    # horovodrun's gloo output: "[0]<stdout>:c1", "[1]<stdout>:c2"
    assert "[0]<stdout>:c1" in done.stdout and "[1]<stdout>:c2" in done.stdout, done.stdout
    after = machine_state()
    assert after["etc_hosts"] == before["etc_hosts"] and after["links"] == before["links"]
    assert not any("-c1" in ns or "-c2" in ns for ns in after["netns"])


@pytest.mark.parametrize("names,message", [
    ([], "at least 2"),
    (["h1"], "at least 2"),
    ("", "at least 2"),
    (["h1", "h1"], "repeat: h1"),
    ("h1:2,h2:1,h1:1", "repeat: h1"),
    (["h1", "h_2"], "'h_2' is not a host name"),
    (["h1", "H2"], "'H2' is not a host name"),
    (["h1", "2"], "'2' is not a host name"),
    (["h1", "localhost"], "'localhost' is not a host name"),
    (["h1", "x" * 64], "at most 63"),
    (["h1", "h2:0"], "slots must be a positive integer"),
    ([f"h{i}" for i in range(MAX_HOSTS + 1)], f"at most {MAX_HOSTS} are supported"),
])
def test_host_lists_the_emulator_cannot_build_are_refused_by_name(names, message):
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        EmulatedHosts(names)
    assert subprocess.run(["ip", "netns", "list"], capture_output=True,
                          text=True).stdout == listed


def test_a_missing_sshd_says_which_package_installs_it():
    with pytest.raises(HostsError, match="apt-get install openssh-server") as err:
        EmulatedHosts(["h1", "h2"], sshd="/nonexistent/sbin/sshd")
    assert "/nonexistent/sbin/sshd" in str(err.value) and "tools/install.sh" in str(err.value)


def test_an_sshd_that_cannot_start_is_reported_with_its_log():
    before = machine_state()
    h = EmulatedHosts(["d1", "d2"], sshd_options=["NoSuchOption yes"])
    with pytest.raises(HostsError, match="host d1 is unreachable") as err:
        with h:
            pass
    assert "NoSuchOption" in str(err.value) and "sshd log" in str(err.value), err.value
    assert_all_gone(before, h)
