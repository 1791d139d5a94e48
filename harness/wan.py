"""A two-host WAN on one machine: network namespaces joined by a user-space link.

This kernel has no netem (see ../shared/reference/ENVIRONMENT.md), so delay
cannot come from tc. Instead each of two namespaces gets a TUN device
(``wan0``, 10.77.<n>.1 and .2), and a forwarder process reads every packet from
one TUN and writes it into the other after:

    departure = max(now, previous departure) + size / rate      (a bottleneck)
    arrival   = departure + one-way delay (+ jitter, never reordering)

with tail drop when more than ``queue_bytes`` wait for the bottleneck, and
optional random loss. The TUN MTU is 64 KB so the forwarder, in Python, moves
~2k packets/s per Gbit/s; rates up to ~1 Gbit/s are faithful.

With ``nodes=N > 2`` (emulated hosts, harness/hosts.py) the same forwarder
reads all N TUN devices and sends each IPv4 packet to the namespace that owns
its destination address: a full mesh in which every ordered pair of namespaces
has its own bottleneck and delay, as between sites of a WAN. Two namespaces
behave exactly as before (every packet goes to the other side).

    with WanLink(rate_mbit=100, rtt_ms=50) as link:
        link.popen(0, ["python", "server.py"])      # in namespace 0
        link.run(1, ["python", "client.py", link.ip(0)])

Only namespaces this object created are touched (unique names with the pid),
and they are removed on exit, on an exception, on SIGTERM/SIGINT, and at
interpreter exit. Needs root (CAP_NET_ADMIN) and /dev/net/tun.
"""

import atexit
import ctypes
import fcntl
import os
import random
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import deque

__all__ = ["WanLink", "available"]

CLONE_NEWNET = 0x40000000
TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
MTU = 65000
DEVICE = "wan0"


def device_counters(device=DEVICE):
    """``device``'s counters in this process's network namespace (/proc/net/dev):
    ``{"rx_bytes", "rx_packets", "tx_bytes", "tx_packets"}``, or None where it has none.
    On the TUN device a byte is an IP packet's (headers included, no link layer)."""
    try:
        with open("/proc/net/dev") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name.strip() == device:
                    fields = [int(v) for v in rest.split()]
                    return {"rx_bytes": fields[0], "rx_packets": fields[1],
                            "tx_bytes": fields[8], "tx_packets": fields[9]}
    except OSError:
        pass
    return None


def close_on_exit(close):
    """Call ``close`` at interpreter exit and on SIGTERM/SIGINT (then the handler that
    was there runs, and the process exits): a link or hosts must never outlive the
    process that made them. Returns the handlers replaced, for ``restore_handlers``;
    signals are only handled from the main thread (the only one Python allows)."""
    atexit.register(close)
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

    def on_signal(signum, frame):
        close()
        handler = previous[signum]
        if callable(handler):
            handler(signum, frame)
        raise SystemExit(128 + signum)

    for s in previous:
        signal.signal(s, on_signal)
    return previous


def restore_handlers(previous):
    """Put back the signal handlers ``close_on_exit`` replaced."""
    for s, handler in previous.items():
        signal.signal(s, handler)


class ClosedOnExit:
    """A context manager for set-up that must not outlive its process (WanLink,
    hosts.EmulatedHosts): ``_setup`` runs with ``close_on_exit`` armed, a failure in it
    closes what was made, and ``close`` calls ``_disarm`` where its order needs it."""

    _handlers = {}

    def __enter__(self):
        self._handlers = close_on_exit(self.close)
        try:
            self._setup()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()

    def _disarm(self):
        """Put back the signal handlers ``__enter__`` replaced."""
        restore_handlers(self._handlers)
        self._handlers = {}


def available():
    """(ok, why): can this process build a link here?"""
    if os.geteuid() != 0:
        return False, "needs root (network namespaces, TUN devices)"
    if not os.path.exists("/dev/net/tun"):
        return False, "no /dev/net/tun"
    try:
        subprocess.run(["ip", "netns", "list"], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        return False, f"`ip netns` unusable: {exc}"
    return True, ""


def _setns(fd):
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def _tun_in(namespace):
    """A TUN device created inside ``namespace``; the fd works from anywhere."""
    home = os.open("/proc/self/ns/net", os.O_RDONLY)
    target = os.open(f"/var/run/netns/{namespace}", os.O_RDONLY)
    try:
        _setns(target)
        fd = os.open("/dev/net/tun", os.O_RDWR)
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", DEVICE.encode(), IFF_TUN | IFF_NO_PI))
        return fd
    finally:
        _setns(home)
        os.close(home)
        os.close(target)


class _Direction:
    """One way of the link: a bottleneck of ``rate`` bytes/s, then ``delay`` seconds."""

    def __init__(self, dst, rate, delay, jitter, loss, queue_bytes, rng):
        self.dst = dst
        self.rate, self.delay, self.jitter, self.loss = rate, delay, jitter, loss
        self.queue_bytes = queue_bytes
        self.rng = rng
        self.free_at = 0.0  # when the bottleneck finishes what it already holds
        self.last_arrival = 0.0
        self.in_flight = deque()  # (arrival time, packet), in arrival order
        self.dropped = 0

    def accept(self, packet, now):
        if self.loss and self.rng.random() < self.loss:
            self.dropped += 1
            return
        start = max(now, self.free_at)
        if self.rate and (start - now) * self.rate + len(packet) > self.queue_bytes:
            self.dropped += 1  # tail drop: the bottleneck's buffer is full
            return
        departure = start + (len(packet) / self.rate if self.rate else 0.0)
        self.free_at = departure
        arrival = departure + self.delay
        if self.jitter:
            arrival += self.rng.uniform(-self.jitter, self.jitter)
        arrival = max(arrival, self.last_arrival, departure)  # FIFO: no reordering
        self.last_arrival = arrival
        self.in_flight.append((arrival, packet))

    def deliver(self, now):
        while self.in_flight and self.in_flight[0][0] <= now:
            packet = self.in_flight.popleft()[1]
            try:
                os.write(self.dst, packet)
            except OSError:  # the far side went down: drop, as a wire would
                self.dropped += 1

    def next_time(self):
        return self.in_flight[0][0] if self.in_flight else None


def _route(packet, subnet, nodes):
    """Index of the namespace a packet is for, or None (not IPv4 to 10.<subnet>.0.<1..N>)."""
    if len(packet) < 20 or packet[0] >> 4 != 4:
        return None
    if packet[16] != 10 or packet[17] != subnet or packet[18] != 0:
        return None
    index = packet[19] - 1
    return index if 0 <= index < nodes else None


def _forward(fds, stop_fd, rate, delay, jitter, loss, queue_bytes, seed, subnet=None,
             control_fd=None):
    """Forward packets between the namespaces' devices until ``stop_fd`` is readable;
    a line on ``control_fd`` (``WanLink.set_rate``) is the bottleneck's new rate."""
    rng = random.Random(seed)
    n = len(fds)
    # One bottleneck per ordered pair (source fd, destination index): pairs do not share.
    ways = {(src, b): _Direction(fds[b], rate, delay, jitter, loss, queue_bytes, rng)
            for a, src in enumerate(fds) for b in range(n) if b != a}
    while True:
        pending = [t for t in (w.next_time() for w in ways.values()) if t is not None]
        timeout = max(0.0, min(pending) - time.monotonic()) if pending else 0.5
        controls = [control_fd] if control_fd is not None else []
        ready, _, _ = select.select([*fds, stop_fd, *controls], [], [], timeout)
        if stop_fd in ready:
            return
        if controls and control_fd in ready:
            line = os.read(control_fd, 256).split()
            if line:
                for way in ways.values():  # what is queued keeps its departure time
                    way.rate = float(line[-1])
        now = time.monotonic()
        for fd in ready:
            if fd == control_fd:
                continue
            try:
                packet = os.read(fd, MTU + 1024)
            except BlockingIOError:
                continue
            if n == 2:  # a plain wire: whatever one side sends reaches the other
                dst = 1 - fds.index(fd)
            else:
                dst = _route(packet, subnet, n)
                if dst is None or fds[dst] == fd:
                    continue  # no such host here: lost, as on a wire
            ways[(fd, dst)].accept(packet, now)
        now = time.monotonic()
        for way in ways.values():
            way.deliver(now)


class WanLink(ClosedOnExit):
    """Two (or ``nodes``) namespaces joined by an emulated link (see the module docstring).

    Args:
        rate_mbit: bottleneck rate in Mbit/s each way (None: unlimited).
        rtt_ms: round-trip time; each way gets half as its one-way delay.
        jitter_ms: uniform +- jitter on each packet's delay (order is kept).
        loss: probability a packet is dropped, each way.
        queue_bytes: the bottleneck's buffer; default twice the bandwidth-delay
            product plus 256 KB, so TCP can fill the link.
        nodes: how many namespaces (2 to 254); namespace i has address ip(i).
        names: the namespaces' names, when the caller wants its own (they must
            not exist yet; they are created and removed here like the default ones).
    """

    def __init__(self, rate_mbit=None, rtt_ms=0.0, jitter_ms=0.0, loss=0.0, queue_bytes=None,
                 subnet=77, seed=0, nodes=2, names=None):
        ok, why = available()
        if not ok:
            raise RuntimeError(f"WanLink: {why}")
        self.rate = rate_mbit * 1e6 / 8 if rate_mbit else 0.0
        self.delay = rtt_ms / 2000.0
        self.jitter = jitter_ms / 1000.0
        self.loss = float(loss)
        if queue_bytes is None:
            queue_bytes = 2 * self.rate * 2 * self.delay + 256 * 1024
        self.queue_bytes = queue_bytes
        self.subnet, self.seed = subnet, seed
        if names is not None:
            nodes = len(names)
        if not 2 <= nodes <= 254:
            raise ValueError(f"WanLink: {nodes} namespaces; a link joins 2 to 254")
        self.namespaces = (list(names) if names is not None else
                           [f"hvddgc{os.getpid()}s{subnet}n{i}" for i in range(nodes)])
        self._created = []
        self._forwarder = None
        self._stop_w = None
        self.description = (f"{rate_mbit or 'unlimited'} Mbit/s, RTT {rtt_ms:g} ms"
                            + (f", jitter {jitter_ms:g} ms" if jitter_ms else "")
                            + (f", loss {loss:g}" if loss else ""))

    def ip(self, i):
        return f"10.{self.subnet}.0.{i + 1}"

    # -- set-up and tear-down (ClosedOnExit: __enter__, __exit__) -------------------
    def _ip(self, *args):
        subprocess.run(["ip", *args], check=True, capture_output=True)

    def _setup(self):
        for ns in self.namespaces:
            self._ip("netns", "add", ns)
            self._created.append(ns)
        fds = [_tun_in(ns) for ns in self.namespaces]
        for i, ns in enumerate(self.namespaces):
            # `ip netns exec` mounts /etc/netns/<ns>/hosts over /etc/hosts: there this
            # machine's name is the namespace's wan0 address. Gloo needs it: Horovod
            # 0.28.1 gives HOROVOD_GLOO_IFACE to its global context only, and the
            # process-set contexts find their address from the host name.
            os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
            with open(f"/etc/netns/{ns}/hosts", "w") as f:
                f.write(f"127.0.0.1 localhost\n{self.ip(i)} {socket.gethostname()}\n")
            self._ip("-n", ns, "link", "set", "lo", "up")
            self._ip("-n", ns, "addr", "add", f"{self.ip(i)}/24", "dev", DEVICE)
            self._ip("-n", ns, "link", "set", DEVICE, "mtu", str(MTU), "up")
            # Hosts tuned for long fat pipes: TCP windows up to 64 MB (the default
            # 6 MB caps one stream at ~240 Mbit/s over a 200 ms round trip).
            for key in ("net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem"):
                subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw",
                                f"{key}=4096 131072 67108864"], capture_output=True)
        stop_r, self._stop_w = os.pipe()
        control_r, self._control_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the forwarder
            code = 0
            try:
                os.close(self._stop_w)
                os.close(self._control_w)
                _forward(fds, stop_r, self.rate, self.delay, self.jitter, self.loss,
                         self.queue_bytes, self.seed, self.subnet, control_r)
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        self._forwarder = pid
        os.close(stop_r)
        os.close(control_r)
        for fd in fds:  # the forwarder holds them; the devices die with it
            os.close(fd)

    def set_rate(self, rate_mbit):
        """Change the bottleneck's rate, each way, while the link runs (None: unlimited):
        a link that gets slower or faster under a running job."""
        self.rate = rate_mbit * 1e6 / 8 if rate_mbit else 0.0
        os.write(self._control_w, f"{self.rate!r}\n".encode())

    def close(self):
        self._disarm()
        if self._forwarder:
            try:
                os.write(self._stop_w, b"x")
                os.close(self._stop_w)
                os.close(self._control_w)
            except OSError:
                pass
            for _ in range(50):
                if os.waitpid(self._forwarder, os.WNOHANG) != (0, 0):
                    break
                time.sleep(0.02)
            else:
                os.kill(self._forwarder, signal.SIGKILL)
                os.waitpid(self._forwarder, 0)
            self._forwarder = None
        while self._created:
            ns = self._created.pop()
            self._kill_inside(ns)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)

    @staticmethod
    def _kill_inside(ns):
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                              text=True).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (OSError, ValueError):
                pass

    # -- running things on either side ------------------------------------------
    def command(self, i, argv):
        return ["ip", "netns", "exec", self.namespaces[i], *argv]

    def popen(self, i, argv, **kwargs):
        return subprocess.Popen(self.command(i, argv), **kwargs)

    def run(self, i, argv, **kwargs):
        return subprocess.run(self.command(i, argv), **kwargs)


def _main():
    import argparse
    ap = argparse.ArgumentParser(description="Hold an emulated link open until Enter/Ctrl-C.")
    ap.add_argument("--rate-mbit", type=float, default=100)
    ap.add_argument("--rtt-ms", type=float, default=50)
    ap.add_argument("--loss", type=float, default=0.0)
    ap.add_argument("--jitter-ms", type=float, default=0.0)
    args = ap.parse_args()
    with WanLink(args.rate_mbit, args.rtt_ms, args.jitter_ms, args.loss) as link:
        print(f"{link.description}: namespaces {link.namespaces}, {link.ip(0)} <-> "
              f"{link.ip(1)}; `ip netns exec {link.namespaces[0]} ...`. Enter to stop.")
        try:
            sys.stdin.readline()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    _main()
