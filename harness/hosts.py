"""Emulated hosts that Horovod's own, unmodified ``horovodrun`` reaches over real ssh.

harness/launch.py stands in for horovodrun, so it cannot show that a job
launched the way users launch it (host list, ssh, Horovod's driver and task
services picking a common interface, Gloo rendezvous or mpirun's orted) works
across a slow link. Here each host is a network namespace on this machine,
the namespaces are joined by the WAN emulator (harness/wan.py, one
bottleneck and delay per pair of hosts), and each runs a real Debian sshd:

    with EmulatedHosts(["h1:2", "h2:2"], rate_mbit=100, rtt_ms=50) as hosts:
        done = hosts.horovodrun(["-np", "4", "-H", "h1:2,h2:2", "--gloo",
                                 "python", "train.py"], timeout=600)

    python -m harness.hosts run --hosts h1:2,h2:2 --rate-mbit 100 --rtt-ms 50 \\
        -- -np 4 -H h1:2,h2:2 --gloo python train.py

Where things live, and why:
- horovodrun runs on the first host, as a user would start it on one node of a
  cluster. Horovod then treats that host as local (its name resolves to one of
  its addresses) and reaches the others with ssh; its rendezvous server and
  driver service listen on the first host's address, which every host routes to.
- The ranks of one host share its namespace, so their traffic to each other
  stays inside it; traffic between hosts crosses the emulated link.
- Host names resolve through a hosts file per namespace
  (/etc/netns/<namespace>/hosts, which ``ip netns exec`` mounts over /etc/hosts
  for what runs inside). The machine's own /etc/hosts is never written, so
  nothing outside the namespaces can see or be broken by these names.
- The ssh client inside the namespaces reads /etc/netns/<namespace>/ssh (mounted
  over /etc/ssh the same way): host keys that change every run are not checked
  and never written to ~/.ssh/known_hosts, and ``ssh h2`` works by hand too.
  horovodrun still gets ``--ssh-port`` and ``--ssh-identity-file`` explicitly,
  which it hands on to mpirun as ``-mca plm_rsh_args``.
- Each host has its own host name (a UTS namespace held by its sshd), so
  ``hostname`` inside says h1 or h2, as Open MPI and Gloo expect of real hosts.

Start-up and tear-down are one object: namespaces, TUN devices (inside the
namespaces), sshd (stopped by its pid file), every process in the namespaces,
the per-namespace files and the temporary key directory go on normal exit, on
an exception, on SIGTERM/SIGINT and at interpreter exit. ``python -m
harness.hosts down`` removes what a SIGKILLed run left. Needs root,
/dev/net/tun and openssh-server (tools/install.sh installs it).
"""

import argparse
import atexit
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness.wan import ClosedOnExit, WanLink, available  # noqa: E402

__all__ = ["EmulatedHosts", "HostsError", "parse_hosts", "available", "MAX_HOSTS"]

# One Python forwarder carries every pair's traffic (N*(N-1) bottlenecks) on a
# 2-core machine; past this it, not the emulated link, would set the pace.
MAX_HOSTS = 16
SUBNET = 78  # 10.78.0.<i+1>: apart from WanLink's default 10.77 for readability
DEFAULT_SSHD = "/usr/sbin/sshd"
PREFIX = "hvddgc"  # WanLink's prefix too: `down` recognises both by the pid after it
INSTALL_SSHD = ("install openssh-server: apt-get install openssh-server "
                "(tools/install.sh installs it)")
_NAME = re.compile(r"^[a-z]([a-z0-9-]{0,61}[a-z0-9])?$")
_instances = iter(range(1 << 30))


class HostsError(RuntimeError):
    """The hosts could not be brought up here; the message says what to change."""


def parse_hosts(hosts):
    """[(name, slots)] from "h1:2,h2:2", ["h1", "h2:2"] or [("h1", 2)]; checked as a set.

    Raises ValueError naming the fix for a list the emulator cannot build.
    """
    if isinstance(hosts, str):
        hosts = [h for h in hosts.split(",") if h.strip()] if hosts.strip() else []
    parsed = []
    for host in hosts:
        if isinstance(host, (tuple, list)):
            name, slots = host
        else:
            name, _, slots = str(host).strip().partition(":")
            slots = slots or 1
        try:
            slots = int(slots)
        except ValueError:
            slots = 0
        if slots < 1:
            raise ValueError(f"host {host!r}: slots must be a positive integer, as in h1:2")
        name = str(name).strip()
        if not _NAME.match(name) or name == "localhost":
            raise ValueError(
                f"{name!r} is not a host name the emulator can use: lower-case letters, "
                f"digits and '-', starting with a letter and not ending with '-', at most "
                f"63 characters, not 'localhost' (e.g. h1, node-2)")
        parsed.append((name, slots))
    names = [n for n, _ in parsed]
    if len(names) < 2:
        raise ValueError(
            f"{len(names)} host(s) given: emulated hosts need at least 2 (a single host "
            f"has no link to emulate and horovodrun would not use ssh), e.g. --hosts h1:2,h2:2")
    if len(names) > MAX_HOSTS:
        raise ValueError(f"{len(names)} hosts given: at most {MAX_HOSTS} are supported "
                         f"(one forwarder process carries all their traffic)")
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"host names repeat: {', '.join(duplicates)}; give each host once "
                         f"and its ranks as slots (h1:2, not h1,h1)")
    return parsed


def _tools(sshd):
    """Absolute paths of the programs needed, or HostsError naming the package."""
    path = sshd if os.path.isabs(sshd) else shutil.which(sshd)
    if not path or not os.path.isfile(path) or not os.access(path, os.X_OK):
        raise HostsError(f"no sshd at {sshd!r}: {INSTALL_SSHD}")
    found = {"sshd": path}  # sshd re-executes itself: it needs an absolute path
    for tool, package in (("ssh", "openssh-client"), ("ssh-keygen", "openssh-client"),
                          ("nsenter", "util-linux"), ("unshare", "util-linux")):
        found[tool] = shutil.which(tool)
        if not found[tool]:
            raise HostsError(f"no {tool} on PATH: install {package}: apt-get install "
                             f"{package} (tools/install.sh installs it)")
    return found


class EmulatedHosts(ClosedOnExit):
    """Hosts ``names`` on an emulated WAN, each with a real sshd (see the module docstring).

    Args:
        names: host names, with optional slots ("h1:2"); the slots fill in
            horovodrun's -np and -H when a command line leaves them out.
        rate_mbit, rtt_ms, jitter_ms, loss: the link between every two hosts
            (harness/wan.WanLink); None/0 means unlimited/none.
        ssh_port: the port sshd listens on inside each host (each namespace has
            its own ports, so 22 clashes with nothing).
        sshd: the sshd binary (a path; tests point it at a missing file).
        sshd_options: extra sshd_config lines, e.g. ["LogLevel DEBUG1"].
        start_timeout: seconds for every sshd to listen and answer ssh.
    """

    def __init__(self, names=("h1", "h2"), rate_mbit=None, rtt_ms=0.0, jitter_ms=0.0,
                 loss=0.0, ssh_port=22, sshd=DEFAULT_SSHD, sshd_options=(),
                 start_timeout=20.0, subnet=SUBNET):
        parsed = parse_hosts(names)
        self.names = [n for n, _ in parsed]
        self.slots = dict(parsed)
        ok, why = available()
        if not ok:
            raise HostsError(f"emulated hosts unavailable here: {why}")
        self.tools = _tools(sshd)
        self.ssh_port = int(ssh_port)
        self.sshd_options = list(sshd_options)
        self.start_timeout = float(start_timeout)
        self.subnet = subnet
        tag = f"{PREFIX}{os.getpid()}e{next(_instances)}"
        self.namespaces = {n: f"{tag}-{n}" for n in self.names}
        self.link = WanLink(rate_mbit, rtt_ms, jitter_ms, loss, subnet=subnet,
                            names=[self.namespaces[n] for n in self.names])
        self.description = f"{len(self.names)} hosts, each pair {self.link.description}"
        self.tmpdir = None
        self.identity_file = None
        self._sshd = {}  # name -> Popen of its sshd (started with -D: it stays our child)
        self._up = False

    # -- addresses and files ------------------------------------------------------
    def ip(self, name):
        return self.link.ip(self.names.index(name))

    def namespace(self, name):
        return self.namespaces[name]

    def sshd_pid(self, name):
        """The pid in sshd's pid file (None before it listens or after it stopped)."""
        try:
            with open(self._path(name, "sshd.pid")) as f:
                return int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def sshd_log(self, name):
        try:
            with open(self._path(name, "sshd.log")) as f:
                return f.read()
        except OSError:
            return "(no log)"

    def _path(self, name, leaf):
        return os.path.join(self.tmpdir or "/nonexistent", name, leaf)

    # -- set-up and tear-down (ClosedOnExit: __enter__, __exit__) -------------------
    def _setup(self):
        self._up = True
        self.tmpdir = tempfile.mkdtemp(prefix=f"{PREFIX}-hosts-{os.getpid()}-")
        self.identity_file = os.path.join(self.tmpdir, "id_ed25519")
        self._keygen(self.identity_file, "hvd_dgc emulated hosts client")
        self.link.__enter__()
        # sshd's privilege separation directory (Debian's service makes it at boot).
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
        machine = socket.gethostname()
        for i, name in enumerate(self.names):
            os.makedirs(os.path.join(self.tmpdir, name))
            self._keygen(self._path(name, "host_ed25519"), f"{name} host key")
            etc = f"/etc/netns/{self.namespaces[name]}"  # made (and removed) by WanLink
            with open(f"{etc}/hosts", "w") as f:
                f.write("127.0.0.1 localhost\n")
                for j, other in enumerate(self.names):
                    # the machine's name too, for anything started without our UTS name
                    alias = f" {machine}" if j == i and machine not in self.names else ""
                    f.write(f"{self.link.ip(j)} {other}{alias}\n")
            os.makedirs(f"{etc}/ssh")
            with open(f"{etc}/ssh/ssh_config", "w") as f:
                f.write("Host *\n"
                        f"  Port {self.ssh_port}\n"
                        f"  IdentityFile {self.identity_file}\n"
                        "  User root\n"
                        "  BatchMode yes\n"
                        "  StrictHostKeyChecking no\n"
                        "  UserKnownHostsFile /dev/null\n"
                        "  GlobalKnownHostsFile /dev/null\n"
                        "  LogLevel ERROR\n")
            with open(self._path(name, "sshd_config"), "w") as f:
                f.write("\n".join([
                    f"ListenAddress 0.0.0.0:{self.ssh_port}",
                    f"HostKey {self._path(name, 'host_ed25519')}",
                    f"PidFile {self._path(name, 'sshd.pid')}",
                    f"AuthorizedKeysFile {self.identity_file}.pub",
                    "PermitRootLogin prohibit-password",
                    "PubkeyAuthentication yes",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "UsePAM no",
                    "StrictModes no",  # the keys sit in a temporary directory
                    "PrintMotd no",
                    "PrintLastLog no",
                    "UseDNS no",
                    "MaxStartups 100:30:200",  # horovodrun opens one session per rank at once
                    "MaxSessions 100",
                    *self.sshd_options]) + "\n")
            with open(self._path(name, "sshd.log"), "w") as log:
                # -D: sshd stays our child (its exit at start is seen, it is reaped here);
                # its own UTS namespace gives the host its name.
                self._sshd[name] = subprocess.Popen(
                    ["ip", "netns", "exec", self.namespaces[name], self.tools["unshare"],
                     "--uts", "sh", "-c", 'hostname "$1" && exec "$2" -D -f "$3" -E "$4"', "sh",
                     name, self.tools["sshd"], self._path(name, "sshd_config"),
                     self._path(name, "sshd.log")],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        self._wait_for_sshd()

    def _keygen(self, path, comment):
        subprocess.run([self.tools["ssh-keygen"], "-q", "-t", "ed25519", "-N", "", "-C", comment,
                        "-f", path], check=True, capture_output=True)

    def _wait_for_sshd(self):
        deadline = time.monotonic() + self.start_timeout
        for name, proc in self._sshd.items():
            while self.sshd_pid(name) != proc.pid:
                if proc.poll() is not None:
                    raise HostsError(f"host {name} is unreachable: its sshd exited with code "
                                     f"{proc.returncode} at start.\n--- sshd log "
                                     f"({self._path(name, 'sshd.log')}) ---\n{self.sshd_log(name)}")
                if time.monotonic() > deadline:
                    raise HostsError(f"host {name} is unreachable: its sshd did not listen within "
                                     f"{self.start_timeout:g} s.\n--- sshd log ---\n"
                                     f"{self.sshd_log(name)}")
                time.sleep(0.02)
        # Listening is not answering: log in to every host from the launching one.
        first = self.names[0]
        probes = {name: self.popen(first, [self.tools["ssh"], *self.ssh_args(), "-o",
                                           f"ConnectTimeout={max(1, int(self.start_timeout))}",
                                           name, "hostname"],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                  for name in self.names}
        for name, probe in probes.items():
            try:
                out, err = probe.communicate(timeout=self.start_timeout + 5)
            except subprocess.TimeoutExpired:
                probe.kill()
                out, err = probe.communicate()
            if probe.returncode != 0 or out.strip() != name:
                raise HostsError(
                    f"host {name} is unreachable: `ssh {name} hostname` from {first} exited "
                    f"with {probe.returncode} and printed {out.strip()!r}.\n--- ssh stderr ---\n"
                    f"{err}\n--- sshd log of {name} ---\n{self.sshd_log(name)}")

    def close(self):
        """Stop sshd, kill everything in the namespaces, remove all that set-up made."""
        if self._up:
            self._up = False
            for name, proc in self._sshd.items():
                # By its pid file, checked against our own child so a reused pid is never hit.
                pid = self.sshd_pid(name)
                if proc.poll() is None and pid == proc.pid:
                    try:
                        os.kill(pid, signal.SIGTERM)
                    except OSError:
                        pass
            for proc in self._sshd.values():
                try:
                    proc.wait(timeout=3)
                except subprocess.TimeoutExpired:
                    proc.kill()
            self.link.close()  # SIGKILLs what is still inside; deletes namespaces, /etc/netns/*
            for proc in self._sshd.values():
                proc.wait()
            self._sshd = {}
            if self.tmpdir:
                shutil.rmtree(self.tmpdir, ignore_errors=True)
            atexit.unregister(self.close)
        # Last: the link's close puts back the handler it found, which is ours.
        self._disarm()

    # -- running things on a host ------------------------------------------------------
    def command(self, name, argv):
        """``argv`` as run on host ``name``: its network namespace, /etc files and host name."""
        if name not in self._sshd:
            raise HostsError(f"host {name!r} is not up: hosts {self.names} run inside "
                             f"`with EmulatedHosts(...) as hosts:`")
        pid = self._sshd[name].pid
        return ["ip", "netns", "exec", self.namespaces[name], self.tools["nsenter"], "-t",
                str(pid), "-u", "--", *argv]

    def popen(self, name, argv, **kwargs):
        return subprocess.Popen(self.command(name, argv), **kwargs)

    def run(self, name, argv, **kwargs):
        return subprocess.run(self.command(name, argv), **kwargs)

    def ssh_args(self):
        """ssh's own options for these hosts (the namespace's ssh_config has them too)."""
        return ["-p", str(self.ssh_port), "-i", self.identity_file]

    def horovodrun_args(self, args):
        """horovodrun's options for these hosts, then ``args`` (which win where they repeat).

        -H and -np are filled in from the hosts' slots when ``args`` gives no host
        list; that is judged on the options before the command (a token after an
        option is taken as its value), so the program's own -H does not count.
        """
        args = list(args)
        given, i = set(), 0
        while i < len(args) and args[i].startswith("-"):
            given.add(args[i].split("=")[0])
            i += 1 if "=" in args[i] or i + 1 >= len(args) or args[i + 1].startswith("-") else 2
        extra = ["--ssh-port", str(self.ssh_port), "--ssh-identity-file", self.identity_file]
        # Its cache remembers which hosts answered ssh: wrong once these are gone.
        if "--disable-cache" not in given:
            extra.append("--disable-cache")
        if not given & {"-H", "--hosts", "-hostfile", "--hostfile", "--host-discovery-script"}:
            extra += ["-H", ",".join(f"{n}:{self.slots[n]}" for n in self.names)]
            if not given & {"-np", "--num-proc"}:
                extra += ["-np", str(sum(self.slots.values()))]
        return extra + args

    def kill_jobs(self):
        """SIGKILL everything on the hosts but their sshd listeners (a job past its time)."""
        keep = {p.pid for p in self._sshd.values()}
        for ns in self.namespaces.values():
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                                  text=True).stdout.split()
            for pid in pids:
                if int(pid) not in keep:
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except OSError:
                        pass

    def horovodrun(self, args, env=None, timeout=None, capture_output=True, text=True,
                   check=False, cwd=None, horovodrun=None):
        """Run Horovod's ``horovodrun *args`` on the first host; a CompletedProcess.

        ``env`` adds to this process's environment, which horovodrun hands on to
        every rank; the directory of ``horovodrun`` goes first on PATH so that
        ``python`` means the same interpreter on every host. Past ``timeout``
        the job is stopped on every host and subprocess.TimeoutExpired raised.
        """
        exe = horovodrun or _horovodrun_path()
        if not exe:
            raise HostsError("no horovodrun: install Horovod (tools/install.sh builds it)")
        full_env = dict(os.environ)
        full_env.update(env or {})
        full_env["PATH"] = (os.path.dirname(os.path.abspath(exe)) + os.pathsep
                            + full_env.get("PATH", ""))
        if os.geteuid() == 0:  # Open MPI refuses root unless told
            full_env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
            full_env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        argv = [exe, *self.horovodrun_args(args)]
        pipe = subprocess.PIPE if capture_output else None
        proc = self.popen(self.names[0], argv, env=full_env, cwd=cwd, stdout=pipe, stderr=pipe,
                          text=text, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGTERM)  # horovodrun stops what it started
                out, err = proc.communicate(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                out = err = None
            self.kill_jobs()
            if out is None:
                out, err = proc.communicate()
            raise subprocess.TimeoutExpired(argv, timeout, out, err)
        done = subprocess.CompletedProcess(argv, proc.returncode, out, err)
        if check:
            done.check_returncode()
        return done


def _horovodrun_path():
    exe = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    return exe if os.path.exists(exe) else shutil.which("horovodrun")


def clean_leftovers(verbose=True):
    """Remove namespaces, their /etc/netns files and key directories of dead runs.

    Only what carries this project's prefix and the pid of a process that no
    longer exists: a run that is still going is left alone.
    """
    def dead(pid):
        return not os.path.exists(f"/proc/{pid}")

    removed = []
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for line in listing.splitlines():
        ns = line.split()[0] if line.split() else ""
        m = re.match(rf"^{PREFIX}(\d+)", ns)
        if m and dead(m.group(1)):
            WanLink._kill_inside(ns)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
            removed.append(f"namespace {ns}")
    if os.path.isdir("/etc/netns"):
        for ns in os.listdir("/etc/netns"):
            m = re.match(rf"^{PREFIX}(\d+)", ns)
            if m and dead(m.group(1)):
                shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
                removed.append(f"/etc/netns/{ns}")
    tmp = tempfile.gettempdir()
    for entry in os.listdir(tmp):
        m = re.match(rf"^{PREFIX}-hosts-(\d+)-", entry)
        if m and dead(m.group(1)):
            shutil.rmtree(os.path.join(tmp, entry), ignore_errors=True)
            removed.append(os.path.join(tmp, entry))
    if verbose:
        print("removed: " + ", ".join(removed) if removed else "nothing left by dead runs")
    return removed


def _main(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m harness.hosts",
        description="Emulated hosts on a WAN that horovodrun reaches over real ssh.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--hosts", default="h1:2,h2:2", help="names:slots (default h1:2,h2:2)")
    common.add_argument("--rate-mbit", type=float, default=None, help="each way, per pair")
    common.add_argument("--rtt-ms", type=float, default=0.0)
    common.add_argument("--jitter-ms", type=float, default=0.0)
    common.add_argument("--loss", type=float, default=0.0)
    common.add_argument("--ssh-port", type=int, default=22)
    common.add_argument("--sshd", default=DEFAULT_SSHD)
    run = sub.add_parser("run", parents=[common],
                         help="set up, run horovodrun on the first host, tear down")
    run.add_argument("--timeout", type=float, default=None)
    run.add_argument("args", nargs=argparse.REMAINDER,
                     help="after --: horovodrun's arguments (-np/-H default to --hosts)")
    sub.add_parser("up", parents=[common], help="hold the hosts up until Enter, Ctrl-C or SIGTERM")
    sub.add_parser("down", help="remove what runs killed with SIGKILL left behind")
    args = ap.parse_args(argv)

    if args.cmd == "down":
        clean_leftovers()
        return 0
    try:
        hosts = EmulatedHosts(args.hosts, args.rate_mbit, args.rtt_ms, args.jitter_ms, args.loss,
                              ssh_port=args.ssh_port, sshd=args.sshd)
    except (ValueError, HostsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.cmd == "run":
        rest = list(args.args)
        if rest and rest[0] == "--":
            rest = rest[1:]
        if rest and os.path.basename(rest[0]) == "horovodrun":
            rest = rest[1:]
        if not rest:
            print("error: nothing to run: give horovodrun's arguments after --, e.g. "
                  "-- --gloo python train.py", file=sys.stderr)
            return 2
        try:
            with hosts:
                print(f"[hosts] {hosts.description}: "
                      + ", ".join(f"{n}={hosts.ip(n)}" for n in hosts.names), flush=True)
                done = hosts.horovodrun(rest, timeout=args.timeout, capture_output=False)
                return done.returncode
        except HostsError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        except subprocess.TimeoutExpired:
            print(f"error: horovodrun ran past --timeout {args.timeout:g} s; stopped",
                  file=sys.stderr)
            return 124
    try:
        with hosts:
            first = hosts.names[0]
            print(f"[hosts] {hosts.description}: "
                  + ", ".join(f"{n}={hosts.ip(n)} (netns {hosts.namespace(n)})"
                              for n in hosts.names))
            print(f"[hosts] run on {first}: "
                  + " ".join(hosts.command(first, ["horovodrun"]))
                  + " " + " ".join(hosts.horovodrun_args(["--gloo", "python", "train.py"])))
            print("[hosts] ready; Enter to stop", flush=True)
            try:
                sys.stdin.readline()
            except KeyboardInterrupt:
                pass
    except HostsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(_main())
