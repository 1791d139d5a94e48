"""Does the emulated link have the delay and rate asked? (harness/wan.py)

``check(rate_mbit, rtt_ms)`` builds a link and measures it. Round trip: small UDP
probes echoed from the far namespace (median of 20; a ping without needing ping).
Rate: one TCP stream for a few seconds, counting the bytes received after the first
second (past slow start). Off when either is off by more than the tolerance (for the
round trip: and by more than 1 ms, the forwarder's own scheduling cost).
Command line: bench/wan/selftest.py.
"""

import subprocess
import sys

from harness.wan import WanLink

PEER = r'''
import socket, sys, time
mode, port = sys.argv[1], int(sys.argv[2])
if mode == "echo":
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(("0.0.0.0", port))
    print("ready", flush=True)
    while True:
        data, addr = s.recvfrom(2048)
        if data == b"stop": break
        s.sendto(data, addr)
else:  # sink: count bytes per arrival time, report bytes after the first second
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port)); s.listen(1); print("ready", flush=True)
    c, _ = s.accept(); t0 = None; counted = 0; t_first = t_last = None
    while True:
        data = c.recv(1 << 20)
        if not data: break
        now = time.monotonic()
        if t0 is None: t0 = now
        if now - t0 >= 1.0:
            if t_first is None: t_first = now
            else: counted += len(data)
            t_last = now
    print(counted / max(t_last - t_first, 1e-9) if t_first and t_last > t_first else 0.0, flush=True)
'''

CLIENT = r'''
import socket, statistics, sys, time
mode, host, port, arg = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
if mode == "echo":
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(5)
    rtts = []
    for i in range(int(arg)):
        t = time.monotonic(); s.sendto(b"probe%d" % i, (host, port)); s.recvfrom(2048)
        rtts.append(time.monotonic() - t); time.sleep(0.01)
    s.sendto(b"stop", (host, port))
    print(statistics.median(rtts[3:]))
else:
    c = socket.create_connection((host, port)); chunk = b"\0" * (1 << 20)
    end = time.monotonic() + arg
    while time.monotonic() < end: c.sendall(chunk)
    c.close()
'''


def _peer(link, mode, port):
    proc = link.popen(1, [sys.executable, "-c", PEER, mode, str(port)],
                      stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def measure(link, seconds=4.0, probes=23):
    """{"rtt_ms": median round trip, "rate_mbit": TCP goodput} across ``link``."""
    echo = _peer(link, "echo", 9901)
    rtt = float(link.run(0, [sys.executable, "-c", CLIENT, "echo", link.ip(1), "9901",
                             str(probes)], capture_output=True, text=True, check=True).stdout)
    echo.wait(timeout=10)
    sink = _peer(link, "sink", 9902)
    link.run(0, [sys.executable, "-c", CLIENT, "tcp", link.ip(1), "9902", str(seconds)],
             check=True, capture_output=True)
    rate = float(sink.communicate(timeout=30)[0].strip())
    return {"rtt_ms": rtt * 1e3, "rate_mbit": rate * 8 / 1e6}


def check(rate_mbit, rtt_ms, tolerance=0.10, seconds=4.0):
    """Build a link, measure it; returns (ok, report dict)."""
    with WanLink(rate_mbit=rate_mbit, rtt_ms=rtt_ms) as link:
        got = measure(link, seconds)
    report = {"asked": {"rate_mbit": rate_mbit, "rtt_ms": rtt_ms}, "measured": got}
    ok = True
    if rtt_ms:
        report["rtt_error"] = got["rtt_ms"] / rtt_ms - 1
        ok &= abs(report["rtt_error"]) <= tolerance or abs(got["rtt_ms"] - rtt_ms) <= 1.0
    if rate_mbit:
        report["rate_error"] = got["rate_mbit"] / rate_mbit - 1
        ok &= abs(report["rate_error"]) <= tolerance
    report["ok"] = bool(ok)
    return ok, report
