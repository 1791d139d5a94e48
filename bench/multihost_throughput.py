"""Training throughput at 2 emulated hosts x 2 ranks: dense Horovod vs flat and hierarchical DGC.

    python bench/multihost_throughput.py --out bench/results/multihost_throughput.md
    python bench/multihost_throughput.py --links 100:0 --workloads cnn --steps 4 --out /tmp/x.md

Each measurement is one launch of Horovod's own, unmodified ``horovodrun -np 4 -H
h1:2,h2:2 --gloo`` on emulated hosts (harness/hosts.py: network namespaces with
real sshd, every pair joined by the emulated link of harness/wan.py). The
two ranks of a host talk over its loopback; only traffic between hosts crosses
the link. Methods (bench/wan/multihost_worker.py runs them):

    dense Horovod                    horovod.torch.DistributedOptimizer, fp32
    Horovod hierarchical allreduce   the same with HOROVOD_HIERARCHICAL_ALLREDUCE=1
    flat DGC                         hvd_dgc, density 0.001, aggregation="flat"
    hierarchical DGC                 hvd_dgc, density 0.001, aggregation="hierarchical"
    hierarchical DGC + DGA           the same with delay=2 (flush at the end, timed apart)
    hvd_dgc, import switched         hvd_dgc at --density, nothing else: each tensor's way
                                     (dense, flat, hierarchical) by the cost model on the
                                     link measured at wrap time (issue 33)
    no communication                 the same 4 ranks on the same hosts, plain torch
                                     SGD, no Horovod, no collectives (the reference rate)

Workloads: the MLP of bench/wan_throughput.py (6.3M parameters, batch 128 per rank:
much gradient for little compute) and a ResNet-18 for 32x32 inputs (11.2M
parameters, batch 8 per rank by default), synthetic data, one CPU thread per rank.

Per (workload, link, method): samples/s of all ranks together over the timed steps
(after warm-up steps; the slowest rank's time), that rate as a fraction of the
no-communication rate measured on the same link session, and bytes per step across
the slow link, both ways:
  measured  wan0 counters of each host's network namespace (/proc/net/dev), read by
            the host's first rank at file barriers around the timed steps: every
            packet that crossed the link, IP/TCP headers and Horovod's own
            negotiation traffic included;
  computed  dense: the ring allreduce formula 2(N-1)/N * n * 4 bytes each way;
            DGC: the records of the compressed tensors that the host's ranks put on
            the wire in the last timed step (compression_stats(); for hierarchical DGC
            the cross-host allgather only, not the in-host reduce-scatter), plus the
            ring formula for the small tensors that go dense.
A launch whose ranks got less than --min-share of the cores (other work on the
machine) is measured again; --resume re-measures only such rows and the missing
ones; --report-only rewrites the markdown and plot from the CSV.
Writes the markdown (--out), a CSV and a PNG next to it, after every measurement,
so an interrupted run keeps what it measured.
"""

import argparse
import csv
import datetime
import glob
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from harness.hosts import EmulatedHosts, HostsError, available  # noqa: E402

WORKER = os.path.join(REPO, "bench", "wan", "multihost_worker.py")
HOSTS = ["h1:2", "h2:2"]
NP, LOCAL_SIZE = 4, 2
METHODS = ["local", "dense", "dense_hier", "dgc_flat", "dgc_hier", "dgc_hier_dga", "dgc"]
LABELS = {"local": "no communication", "dense": "dense Horovod",
          "dense_hier": "Horovod hierarchical allreduce", "dgc_flat": "flat DGC",
          "dgc_hier": "hierarchical DGC", "dgc_hier_dga": "hierarchical DGC + DGA (D=2)",
          "dgc": "hvd_dgc, import switched (paths by cost)"}
WORKLOADS = {"mlp": "MLP 6.3M (batch 128/rank)", "cnn": "ResNet-18 32x32 (batch {b}/rank)"}
FIELDS = ["workload", "rate_mbit", "rtt_ms", "method", "label", "status", "error", "steps",
          "batch", "world", "params", "samples_per_s", "vs_nocomm", "step_s", "cpu_s_per_step", "cpu_share",
          "measured_h1_to_h2_bytes_per_step", "measured_h2_to_h1_bytes_per_step",
          "computed_bytes_per_step_per_host", "records_bytes_per_step_per_host",
          "dense_small_bytes_per_step", "computed_how", "horovod_idle_bytes_per_s", "horovod_idle_cpu_per_s",
          "tcp_retrans_segs_per_step", "dgc_paths", "flush_s",
          "launch_s", "loadavg_start", "loadavg_end", "hierarchical_allreduce_env", "attempts",
          "session"]
TEXT_FIELDS = {"workload", "method", "label", "status", "error", "computed_how", "dgc_paths",
               "hierarchical_allreduce_env", "session"}


def parse_links(text):
    links = []
    for part in text.split(","):
        rate, _, rtt = part.strip().partition(":")
        links.append((float(rate), float(rtt or 0)))
    return links


def loadavg():
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def horovod_allreduce_ops():
    """Allreduce/allgather operation classes compiled into this Horovod's torch library."""
    import horovod
    libs = glob.glob(os.path.join(os.path.dirname(horovod.__file__), "torch", "mpi_lib*.so"))
    found = set()
    for lib in libs:
        with open(lib, "rb") as f:
            data = f.read()
        found |= {m.decode() for m in re.findall(rb"N7horovod6common\d+([A-Za-z]+(?:Allreduce|"
                                                 rb"Allgather))E", data)}
    return sorted(found - {"EnqueueTensorAllreduce", "EnqueueTensorAllgather"})


def parse_results(stdout, sync_dir):
    """Each rank's report: its MHRESULT line on stdout, else the file it wrote."""
    reports = {}
    for line in (stdout or "").splitlines():
        if "MHRESULT " in line:
            try:
                r = json.loads(line.split("MHRESULT ", 1)[1])
                reports[r["rank"]] = r
            except (ValueError, KeyError):
                pass
    for path in glob.glob(os.path.join(sync_dir, "rank*.json")):
        try:
            with open(path) as f:
                r = json.load(f)
            reports.setdefault(r["rank"], r)
        except (OSError, ValueError, KeyError):
            pass
    return reports


def measure(hosts, workload, method, rate, rtt, args):
    row = {"workload": workload, "rate_mbit": rate, "rtt_ms": rtt, "method": method,
           "label": LABELS[method], "status": "error", "error": "", "steps": args.steps,
           "world": NP}
    sync_dir = tempfile.mkdtemp(prefix="multihost-bench-")
    env = {"PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "HOROVOD_HIERARCHICAL_ALLREDUCE": "1" if method == "dense_hier" else "0"}
    batch = args.mlp_batch if workload == "mlp" else args.cnn_batch
    argv = ["-np", str(NP), "-H", ",".join(HOSTS), "--gloo", "--start-timeout", "300",
            # the link's device: horovodrun skips its interface discovery (one more
            # round of ssh and Python start-ups per host, minutes on 2 busy cores)
            "--network-interfaces", "wan0",
            sys.executable, WORKER, "--workload", workload, "--method", method,
            "--steps", str(args.steps), "--warmup-steps", str(args.warmup_steps),
            "--batch", str(batch), "--density", str(args.density), "--delay", str(args.delay),
            "--sync-dir", sync_dir]
    row["loadavg_start"] = loadavg()
    started = time.time()
    try:
        done = hosts.horovodrun(argv, env=env, timeout=args.timeout, cwd=REPO)
        out, err, code = done.stdout, done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout if isinstance(exc.stdout, str) else ""
        err, code = f"timed out after {args.timeout} s", None
    row["launch_s"] = round(time.time() - started, 1)
    row["loadavg_end"] = loadavg()
    reports = parse_results(out, sync_dir)
    shutil.rmtree(sync_dir, ignore_errors=True)
    if code != 0 or len(reports) != NP:
        tail = ((err or "") + "\n" + (out or ""))[-3000:]
        row["error"] = (f"horovodrun exit {code}, {len(reports)}/{NP} ranks reported")
        print(f"  FAILED: {row['error']}\n{tail}", flush=True)
        row["error"] += ": " + " | ".join(
            line.strip() for line in tail.splitlines()
            if re.search(r"error|Error|Traceback|refused|timed out", line))[-300:]
        return row
    ranks = [reports[r] for r in range(NP)]
    seconds = max(r["seconds"] for r in ranks)
    row.update(status="ok", batch=ranks[0]["batch"], params=ranks[0]["params"],
               samples_per_s=round(NP * ranks[0]["batch"] * args.steps / seconds, 2),
               step_s=round(seconds / args.steps, 4),
               cpu_s_per_step=round(sum(r["cpu_seconds"] for r in ranks) / NP / args.steps, 4),
               cpu_share=round(sum(r["cpu_seconds"] for r in ranks) / (seconds * os.cpu_count()),
                               3),
               flush_s=round(max(r["flush_seconds"] for r in ranks), 3),
               hierarchical_allreduce_env=",".join(
                   sorted({str(r["hierarchical_allreduce_env"]) for r in ranks})))
    firsts = {r["cross_rank"]: r for r in ranks if r["local_rank"] == 0 and "wan_tx_bytes" in r}
    if 0 in firsts:
        row["measured_h1_to_h2_bytes_per_step"] = round(firsts[0]["wan_tx_bytes"] / args.steps)
    if 1 in firsts:
        row["measured_h2_to_h1_bytes_per_step"] = round(firsts[1]["wan_tx_bytes"] / args.steps)
    cpus = [r["idle_cpu_per_s"] for r in ranks if r.get("idle_cpu_per_s") is not None]
    if cpus:
        row["horovod_idle_cpu_per_s"] = round(sum(cpus) / len(cpus), 3)
    retrans = [f["tcp_retrans_segs"] for f in firsts.values()
               if f.get("tcp_retrans_segs") is not None]
    if retrans:
        row["tcp_retrans_segs_per_step"] = round(sum(retrans) / args.steps, 1)
    idle = [f["idle_tx_bytes_per_s"] for f in firsts.values()
            if f.get("idle_tx_bytes_per_s") is not None]
    if idle:
        row["horovod_idle_bytes_per_s"] = round(max(idle))
    if method in ("dense", "dense_hier"):
        row["computed_bytes_per_step_per_host"] = round(2 * (NP - 1) / NP * row["params"] * 4)
        row["computed_how"] = "ring allreduce 2(N-1)/N*n*4, each way"
    elif method.startswith("dgc"):
        records, dense_numel = {}, 0
        for r in ranks:
            records[r["cross_rank"]] = records.get(r["cross_rank"], 0) + r["last_sparse_bytes"]
            dense_numel = max(dense_numel, r["last_dense_numel"])
        row["records_bytes_per_step_per_host"] = max(records.values())
        row["dense_small_bytes_per_step"] = round(2 * (NP - 1) / NP * dense_numel * 4)
        row["computed_bytes_per_step_per_host"] = (row["records_bytes_per_step_per_host"]
                                                   + row["dense_small_bytes_per_step"])
        row["computed_how"] = ("records: sum of the host's ranks' compression_stats bytes of "
                               "compressed tensors (last step) + ring formula for the tensors "
                               "that go dense")
        paths = {}
        for r in ranks:
            for k, v in r["dgc_paths"].items():
                paths[k] = paths.get(k, 0) + v
        row["dgc_paths"] = ";".join(f"{k}={v}" for k, v in sorted(paths.items()))
    else:
        row["computed_bytes_per_step_per_host"] = 0
        row["computed_how"] = "no collectives"
    return row


def load_previous(path):
    """Rows of an earlier run's CSV (for --resume), with numbers as numbers."""
    rows = []
    try:
        with open(path, newline="") as f:
            for raw in csv.DictReader(f):
                row = {}
                for k, v in raw.items():
                    if v in (None, ""):
                        continue
                    if k in TEXT_FIELDS:
                        row[k] = v
                    else:
                        try:
                            row[k] = float(v)
                        except ValueError:
                            row[k] = v
                rows.append(row)
    except OSError:
        pass
    return rows


def previous_runs(path):
    """[{command, started, minutes}] of the runs an earlier markdown lists (for --resume)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return []
    return [{"command": c, "started": d or "?", "minutes": float(m) if m else None}
            for c, d, m in re.findall(r"^(?:Command|Then|Run \d+): `([^`]*)`(?: \(started "
                                      r"([^,]+), ([\d.]+) min)?", text, re.M)]


def key(r):
    return (r["workload"], float(r["rate_mbit"]), float(r["rtt_ms"]), r["method"])


def set_fractions(rows):
    """vs_nocomm of every ok row: over the no-communication row of its workload and link."""
    refs = {key(r)[:3]: r for r in rows if r["method"] == "local" and r["status"] == "ok"}
    for r in rows:
        ref = refs.get(key(r)[:3])
        if r["status"] == "ok" and ref:
            r["vs_nocomm"] = round(r["samples_per_s"] / ref["samples_per_s"], 4)
        else:
            r.pop("vs_nocomm", None)


def nominal_record_ratio(workload, density):
    """Hierarchical / flat (allgather) records per host by design, from the model's shapes:
    flat: each of the L ranks selects k = ceil(density n) of every compressed tensor;
    hierarchical: each rank selects slice_k(k, n, its slice) of the host's sum."""
    import math
    sys.path.insert(0, os.path.dirname(WORKER))
    from multihost_worker import ResNet18, mlp
    from hvd_dgc.aggregation import slice_k, slices
    model = mlp() if workload == "mlp" else ResNet18()
    flat = hier = 0
    for p in model.parameters():
        n = p.numel()
        if n < 1024:  # min_compress_size: dense in both
            continue
        k = max(1, min(n, int(math.ceil(n * density))))
        flat += LOCAL_SIZE * k
        hier += sum(slice_k(k, n, hi - lo) for lo, hi in slices(n, LOCAL_SIZE))
    return hier / flat, flat, hier


def record_bytes():
    from hvd_dgc.torch.compression import Compression
    return Compression.dgc().record_bytes


def where_it_goes(by, wl, rate, rtt):
    """Where hierarchical DGC's step time goes beyond the no-communication step, from the
    rows' CPU time (the ranks share the machine's cores, so CPU is time here)."""
    ref, h, f = (by.get((wl, rate, rtt, m)) for m in ("local", "dgc_hier", "dgc_flat"))
    if not (ref and h and ref["status"] == h["status"] == "ok"):
        return None
    cores = os.cpu_count()
    gap = h["step_s"] - ref["step_s"]
    extra_cpu = h["cpu_s_per_step"] - ref["cpu_s_per_step"]
    extra_s = extra_cpu * NP / cores
    link_ms = h["computed_bytes_per_step_per_host"] * 8 / (rate * 1e6) * 1e3
    text = (f"- Where the time goes ({wl}, {rate:g} Mbit/s RTT {rtt:g} ms, hierarchical DGC, "
            f"{h.get('vs_nocomm', 0):.0%} of no-comm): a step takes {h['step_s']:.2f} s against "
            f"{ref['step_s']:.2f} s without communication (+{gap:.2f} s). The ranks held "
            f"{h['cpu_share']:.0%} of the cores and each spent {extra_cpu:.2f} CPU-s per step "
            f"beyond the model's {ref['cpu_s_per_step']:.2f}: {extra_s:.2f} s of the {cores} "
            f"cores per step, {extra_s / gap:.0%} of the gap, while the link needs "
            f"~{link_ms:.0f} ms per step for the computed bytes. That CPU is DGC's own work, "
            f"Horovod's background loop, and waiting: a rank waiting for a collective spins "
            f"(see Notes), on cores the ranks still computing need.")
    if h.get("horovod_idle_cpu_per_s") not in (None, ""):
        text += (f" Horovod's background loop accounts for at most "
                 f"{h['horovod_idle_cpu_per_s'] * h['step_s']:.2f} CPU-s of that per rank "
                 f"(its idle rate x the step time).")
    if f and f["status"] == "ok":
        text += (f" Flat DGC spent {f['cpu_s_per_step']:.2f} CPU-s/step/rank "
                 f"({f.get('vs_nocomm', 0):.0%} of no-comm): hierarchical DGC's in-host "
                 f"reduce-scatter of the whole dense gradient ({ref['params'] * 4 / 1e6:.0f} MB "
                 f"per host per step, Gloo alltoall over loopback TCP) and its second round "
                 f"cost {h['cpu_s_per_step'] - f['cpu_s_per_step']:+.2f} CPU-s/step/rank "
                 f"more here, which on ranks sharing 2 cores is time. On real hosts (a core "
                 f"or a GPU per rank, shared memory inside the host) that CPU would not be "
                 f"taken from the other ranks' compute.")
    return text


def mb(x):
    return "" if x in (None, "") else f"{x / 1e6:.2f}" if x >= 1e4 else f"{x / 1e6:.4f}"


def write_outputs(rows, meta, args):
    set_fractions(rows)
    order = {m: i for i, m in enumerate(METHODS)}
    links_order = {l: i for i, l in enumerate(meta["links"])}
    rows.sort(key=lambda r: (links_order.get((float(r["rate_mbit"]), float(r["rtt_ms"])), 99),
                             args.workloads.index(r["workload"])
                             if r["workload"] in args.workloads else 9, order[r["method"]]))
    base = os.path.splitext(args.out)[0]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(base + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in FIELDS})
    by = {(r["workload"], r["rate_mbit"], r["rtt_ms"], r["method"]): r for r in rows}
    L = []
    L.append("# Throughput at 2 emulated hosts x 2 ranks: dense Horovod vs flat and "
             "hierarchical DGC")
    L.append("")
    runs = meta["runs"] + ([{"command": meta["command"], "started": meta["date"],
                             "minutes": meta["wall_min"]}] if meta.get("command") else [])
    for i, run in enumerate(runs):
        minutes = "?" if run["minutes"] is None else f"{run['minutes']:.1f}"
        L.append(f"Run {i + 1}: `{run['command']}` (started {run['started']}, {minutes} min)  ")
    if len(runs) > 1:
        L.append("(--resume: rows of earlier runs measured with the ranks' CPU share >= "
                 f"{args.min_share:.0%} were kept, the others measured again; the session "
                 "column of the CSV says when each was measured.)  ")
    total = sum(r["minutes"] or 0 for r in runs)
    L.append(f"Written: {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}; measuring "
             f"wall time {total:.1f} min in all"
             + ("" if meta["finished"] else " (a run in progress or interrupted)") + ".  ")
    L.append(f"Machine: {meta['machine']}.  ")
    L.append(f"Software: Python {platform.python_version()}, torch {meta['torch']}, "
             f"Horovod {meta['horovod']} (Gloo controller), hvd_dgc from this repository.  ")
    L.append(f"Launch: Horovod's own `horovodrun -np 4 -H h1:2,h2:2 --gloo` through "
             f"`harness/hosts.py` EmulatedHosts (network namespaces with real sshd; "
             f"harness/wan.py between the hosts, each way its own bottleneck). "
             f"{args.warmup_steps} warm-up steps, then {args.steps} timed steps per launch; "
             f"one launch per cell; DGC density {args.density}, no warm-up.")
    L.append("")
    L.append("| workload | link | method | samples/s | vs no-comm | s/step | CPU s/step/rank | "
             "ranks' CPU share | measured MB/step h1→h2 / h2→h1 | computed MB/step/host | "
             "status |")
    L.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        link = f"{r['rate_mbit']:g} Mbit/s, RTT {r['rtt_ms']:g} ms"
        wl = WORKLOADS[r["workload"]].format(b=args.cnn_batch)
        if r["status"] != "ok":
            L.append(f"| {wl} | {link} | {r['label']} | | | | | | | | {r['status']}: "
                     f"{r.get('error', '').replace('|', '/')} |")
            continue
        vs = r.get("vs_nocomm")
        measured = (f"{mb(r.get('measured_h1_to_h2_bytes_per_step'))} / "
                    f"{mb(r.get('measured_h2_to_h1_bytes_per_step'))}")
        computed = mb(r.get("computed_bytes_per_step_per_host"))
        if r.get("records_bytes_per_step_per_host") not in (None, ""):
            computed += f" ({mb(r['records_bytes_per_step_per_host'])} records)"
        extra = "ok"
        if r.get("cpu_share", 1) < args.min_share:
            extra = (f"**contended** (ranks got {r['cpu_share']:.0%} of the cores: other work "
                     f"on the machine; {int(r.get('attempts', 1))} attempt(s))")
        if r["method"] == "dgc_hier_dga":
            extra += f"; flush {r['flush_s']} s"
        if r.get("dgc_paths"):
            extra += f"; paths {r['dgc_paths']}"
        L.append(f"| {wl} | {link} | {r['label']} | {r['samples_per_s']:.1f} | "
                 f"{'' if vs in (None, '') else f'{vs:.0%}'} | {r['step_s']:.3f} | "
                 f"{r['cpu_s_per_step']:.3f} | {r['cpu_share']:.0%} | {measured} | "
                 f"{computed} | {extra} |")
    L.append("")
    L.append("samples/s: all 4 ranks together (4 x batch x steps / the slowest rank's timed "
             "seconds). vs no-comm: that rate over the no-communication rate of the same 4 "
             "ranks on the same hosts (same workload and link; with --resume possibly measured "
             "in another session, both uncontended). "
             "**Measured** bytes: the wan0 counters of each host's namespace over the timed "
             "steps (IP packets that crossed the emulated link, headers and Horovod's "
             "negotiation included). **Computed** bytes: dense = 2(N-1)/N x n x 4 (ring "
             "allreduce, each way); DGC = the records of the compressed tensors that the host's "
             "ranks put on the wire in the last timed step (`compression_stats()`, shown in "
             "brackets; hierarchical DGC's in-host reduce-scatter is not counted: it stays on "
             "the host) + the ring formula for the small tensors that go dense. CPU s/step/rank: process "
             "CPU time of a rank over the timed steps, Horovod's threads included. Ranks' CPU "
             "share: the 4 ranks' CPU time over (timed seconds x "
             f"{os.cpu_count()} cores): well below 100% in the no-communication rows means "
             "other work on the machine took the cores.")
    L.append("")

    # -- targets ------------------------------------------------------------------
    L.append("## Issue targets")
    L.append("")
    links = sorted({(r["rate_mbit"], r["rtt_ms"]) for r in rows})
    for wl in args.workloads:
        for rate, rtt in links:
            flat, hier = by.get((wl, rate, rtt, "dgc_flat")), by.get((wl, rate, rtt, "dgc_hier"))
            if not (flat and hier and flat["status"] == hier["status"] == "ok"):
                continue
            rec = hier["records_bytes_per_step_per_host"] / flat["records_bytes_per_step_per_host"]
            comp = hier["computed_bytes_per_step_per_host"] / flat["computed_bytes_per_step_per_host"]
            meas = []
            for key in ("measured_h1_to_h2_bytes_per_step", "measured_h2_to_h1_bytes_per_step"):
                if flat.get(key) and hier.get(key):
                    meas.append(hier[key] / flat[key])
            verdict = "met" if rec <= 1 / LOCAL_SIZE + 1e-9 else "NOT met"
            nominal = nominal_record_ratio(wl, args.density)
            flat_recs = flat["records_bytes_per_step_per_host"] / record_bytes()
            hier_recs = hier["records_bytes_per_step_per_host"] / record_bytes()
            L.append(f"- Cross-host bytes per host, {wl}, {rate:g} Mbit/s RTT {rtt:g} ms, "
                     f"hierarchical / flat DGC: compressed tensors' records (DGC statistics) "
                     f"**{rec:.3f}** (target <= 1/local_size = {1 / LOCAL_SIZE:.2f}: {verdict}, "
                     f"{mb(hier['records_bytes_per_step_per_host'])} vs "
                     f"{mb(flat['records_bytes_per_step_per_host'])} MB/step); with the "
                     f"tensors that go dense in both (ring formula) {comp:.3f}; by design "
                     f"(k = ceil(density n) per rank and tensor flat, slice_k per slice "
                     f"hierarchical, from the model's shapes) "
                     f"{nominal[0]:.4f}; flat sent {flat_recs / nominal[1]:.1%} and "
                     f"hierarchical {hier_recs / nominal[2]:.1%} of those nominal counts "
                     + ("(flat's region reduce, chosen by its cost model for some tensors, "
                        "sends more than k records)" if "region" in flat.get("dgc_paths", "")
                        else "(DGC's selection is a sampled threshold, not an exact top-k: "
                        "flat's whole-tensor selection returns a little under k, the "
                        "hierarchical per-slice one about k)")
                     + (f"; on the wire (wan0 h1→h2 / h2→h1, Horovod's negotiation included) "
                        f"{' / '.join(f'{m:.3f}' for m in meas)}" if meas else "") + ".")
    cnn = by.get(("cnn", 100.0, 0.0, "dgc_hier"))
    if cnn and cnn["status"] == "ok" and cnn.get("vs_nocomm") not in (None, ""):
        verdict = "met" if cnn["vs_nocomm"] >= 0.85 else "NOT met"
        L.append(f"- ResNet-18 at 100 Mbit/s RTT 0: hierarchical DGC reaches "
                 f"**{cnn['vs_nocomm']:.0%}** of the no-communication rate (target >= 85%: "
                 f"{verdict}).")
    else:
        L.append("- ResNet-18 at 100 Mbit/s RTT 0, hierarchical DGC: not measured in this run.")
    for wl in args.workloads:
        where = where_it_goes(by, wl, 100.0, 0.0)
        if where:
            L.append(where)
    L.append("")
    L.append("## Horovod hierarchical allreduce with Gloo")
    L.append("")
    L.append(meta["hier_note"])
    pairs = []
    for wl in args.workloads:
        for rate, rtt in links:
            a, b = by.get((wl, rate, rtt, "dense")), by.get((wl, rate, rtt, "dense_hier"))
            if a and b and a["status"] == b["status"] == "ok" and \
                    a.get("measured_h1_to_h2_bytes_per_step") and \
                    b.get("measured_h1_to_h2_bytes_per_step"):
                pairs.append(f"{wl} {rate:g}/{rtt:g}: {mb(a['measured_h1_to_h2_bytes_per_step'])}"
                             f" vs {mb(b['measured_h1_to_h2_bytes_per_step'])} MB/step h1→h2, "
                             f"{a['samples_per_s']:.1f} vs {b['samples_per_s']:.1f} samples/s")
    if pairs:
        L.append("")
        L.append("Measured, dense vs HOROVOD_HIERARCHICAL_ALLREDUCE=1 (the variable reached every "
                 "rank: the worker reports it): " + "; ".join(pairs) + ".")
    L.append("")
    L.append("## Notes")
    L.append("")
    L += [f"- {n}" for n in meta["notes"]]
    spread = []
    for r in rows:
        twin = by.get((r["workload"], r["rate_mbit"], r["rtt_ms"], "dense_hier"))
        if r["method"] == "dense" and r["status"] == "ok" and twin and twin["status"] == "ok":
            a, b = r["samples_per_s"], twin["samples_per_s"]
            spread.append(abs(a - b) / min(a, b))
    if spread:
        L.append(f"- Noise: 'dense Horovod' and 'Horovod hierarchical allreduce' run identical "
                 f"code here (see above), so their difference is launch-to-launch noise: "
                 f"{min(spread):.0%}-{max(spread):.0%} (median "
                 f"{sorted(spread)[len(spread) // 2]:.0%}) over {len(spread)} pairs. Read "
                 f"differences smaller than that as ties.")
    L.append("- Measured dense bytes exceed the ring formula at RTT 0 (~44-47 vs 37.9 MB/step "
             "for the MLP) and match it at RTT 50 ms (37.96): at RTT 0 the emulator's "
             "bottleneck buffer is only 256 KB (twice the bandwidth-delay product + 256 KB), "
             "so TCP overruns it and the dropped segments are sent again, and wan0 counts "
             "them. Spot check (a separate 3-step run, dense MLP at 100 Mbit/s, not in the "
             "table): 227 TCP segments retransmitted per step at RTT 0, 1.3 at RTT 50 ms "
             "(/proc/net/snmp RetransSegs of the hosts' namespaces; CSV column "
             "tcp_retrans_segs_per_step, empty for rows measured before it was added).")
    by_rtt = {}
    for r in rows:
        if r.get("horovod_idle_bytes_per_s") not in (None, ""):
            by_rtt.setdefault(r["rtt_ms"], []).append(r)
    if by_rtt:
        parts = []
        for rtt, rs in sorted(by_rtt.items()):
            b = [r["horovod_idle_bytes_per_s"] / 1e3 for r in rs]
            c = [r["horovod_idle_cpu_per_s"] for r in rs
                 if r.get("horovod_idle_cpu_per_s") not in (None, "")]
            parts.append(f"at RTT {rtt:g} ms {min(b):.0f}-{max(b):.0f} KB/s per direction and "
                         f"{min(c):.3f}-{max(c):.3f} CPU-s per second per rank")
        L.append("- Measured bytes include Horovod's own negotiation: its background loop "
                 "exchanges a few bytes with the other ranks every cycle (HOROVOD_CYCLE_TIME), "
                 "tensors or not, and each cycle waits for a round trip. With every rank "
                 "asleep for 1 s after the timed steps (CSV: horovod_idle_bytes_per_s, "
                 "horovod_idle_cpu_per_s): " + "; ".join(parts) + ". At RTT 0 that is most "
                 "of what DGC rows measure on the wire beyond their records, and its CPU is "
                 "taken from the other ranks' compute on shared cores; the no-communication "
                 "rows do not pay it. Upper bounds: the loop cycles less often while the "
                 "ranks compute.")
    if meta["not_run"]:
        L.append("")
        L.append("## Not run")
        L.append("")
        L += [f"- {n}" for n in meta["not_run"]]
    with open(args.out, "w") as f:
        f.write("\n".join(L) + "\n")
    plot(rows, base + ".png", args)
    return "\n".join(L)


def plot(rows, path, args):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    ok = [r for r in rows if r["status"] == "ok" and r["method"] != "local"
          and r.get("vs_nocomm") not in (None, "")]
    if not ok:
        return
    workloads = [w for w in args.workloads if any(r["workload"] == w for r in ok)]
    methods = [m for m in METHODS if m != "local" and any(r["method"] == m for r in ok)]
    fig, axes = plt.subplots(1, len(workloads), figsize=(6.5 * len(workloads), 4.2),
                             squeeze=False)
    for ax, wl in zip(axes[0], workloads):
        links = sorted({(r["rate_mbit"], r["rtt_ms"]) for r in ok if r["workload"] == wl},
                       key=lambda l: (l[1], l[0]))
        width = 0.8 / len(methods)
        for i, m in enumerate(methods):
            ys = []
            for rate, rtt in links:
                r = next((r for r in ok if (r["workload"], r["rate_mbit"], r["rtt_ms"],
                                            r["method"]) == (wl, rate, rtt, m)), None)
                ys.append(r["vs_nocomm"] if r else 0)
            ax.bar([j + i * width for j in range(len(links))], ys, width, label=LABELS[m])
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(links))])
        ax.set_xticklabels([f"{r:g} Mbit/s\nRTT {t:g} ms" for r, t in links], fontsize=8)
        ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
        if wl == "cnn":
            ax.axhline(0.85, color="red", linestyle=":", linewidth=1, label="target 85%")
        ax.set_ylim(0, 1.15)
        ax.set_ylabel("fraction of the no-communication rate")
        ax.set_title(WORKLOADS[wl].format(b=args.cnn_batch) + ", 2 hosts x 2 ranks", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=6, help="timed steps per launch (default 6)")
    ap.add_argument("--warmup-steps", type=int, default=2)
    ap.add_argument("--workloads", default="mlp,cnn")
    ap.add_argument("--links", default="100:0,1000:0,100:50,1000:50",
                    help="rate_mbit:rtt_ms,... in the order run (default %(default)s)")
    ap.add_argument("--methods", default=",".join(METHODS),
                    help="of " + ",".join(METHODS) + "; 'local' (no communication) is "
                    "always run first for each workload and link: the fractions need it")
    ap.add_argument("--mlp-batch", type=int, default=128)
    ap.add_argument("--cnn-batch", type=int, default=8)
    ap.add_argument("--density", type=float, default=0.001)
    ap.add_argument("--delay", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=600, help="seconds per launch")
    ap.add_argument("--budget-minutes", type=float, default=45.0,
                    help="start no launch after this much wall time; the rest is listed "
                    "as not run")
    ap.add_argument("--min-share", type=float, default=0.85,
                    help="a launch whose ranks got less than this share of the machine's "
                    "cores (CPU time / (seconds x cores)) was slowed by other work: it is "
                    "measured again (--retries) and flagged if it stays below")
    ap.add_argument("--retries", type=int, default=1,
                    help="extra attempts for a contended launch, after --retry-wait s; the "
                    "attempt with the highest CPU share is kept")
    ap.add_argument("--retry-wait", type=float, default=30.0)
    ap.add_argument("--resume", action="store_true",
                    help="keep the uncontended ok rows of the CSV next to --out and measure "
                    "only the rest of the grid")
    ap.add_argument("--report-only", action="store_true",
                    help="launch nothing: rewrite the markdown and plot from the CSV next to "
                    "--out (and the runs its markdown lists)")
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results",
                                                  "multihost_throughput.md"))
    args = ap.parse_args()
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in methods + args.workloads:
        if m not in METHODS and m not in WORKLOADS:
            ap.error(f"unknown method or workload {m!r}")
    methods = ["local"] + [m for m in METHODS if m in methods and m != "local"]
    links = parse_links(args.links)
    ok, why = available()
    if not ok and not args.report_only:
        sys.exit(f"multihost_throughput: {why}")

    import horovod
    import torch
    ops = horovod_allreduce_ops()
    hier_ops = [o for o in ops if "Hierarchical" in o and o.endswith("Allreduce")]
    if hier_ops:
        hier_note = (f"This Horovod build has hierarchical allreduce operations ({', '.join(hier_ops)}), "
                     f"but see the measured bytes below for whether Gloo uses them.")
    else:
        hier_note = (f"**HOROVOD_HIERARCHICAL_ALLREDUCE=1 has no effect here.** The operations "
                     f"compiled into this Horovod {horovod.__version__} (horovod/torch/mpi_lib_v2) "
                     f"are {', '.join(ops)}: there is no hierarchical allreduce for CPU tensors "
                     f"at all (Horovod's only one, NCCLHierarchicalAllreduce, is for GPU tensors "
                     f"in NCCL builds), so with --gloo the variable sets a parameter that no "
                     f"operation reads, and the 'Horovod hierarchical allreduce' rows run the "
                     f"same flat Gloo ring allreduce as 'dense Horovod'.")
    command = "python bench/multihost_throughput.py " + " ".join(sys.argv[1:])
    meta = {"runs": previous_runs(args.out) if args.resume or args.report_only else [],
            "command": None if args.report_only else command,
            "links": links,
            "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
            "machine": f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), "
                       f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} "
                       f"GiB; the 4 ranks, the emulator's forwarder, sshd and horovodrun all "
                       f"share these cores",
            "torch": torch.__version__, "horovod": horovod.__version__, "hier_note": hier_note,
            "finished": False, "not_run": [], "wall_min": 0.0}
    meta["notes"] = [
        f"4 ranks x 1 thread on {os.cpu_count()} cores: the ranks of both 'hosts' share the "
        f"same cores, so compute per step is inflated about {NP / os.cpu_count():.0f}x over a "
        f"rank with a core of its own, and any CPU a method spends outside the model (DGC's "
        f"selection, Horovod's threads, the Python forwarder that carries the link's packets, "
        f"the in-host reduce-scatter of hierarchical DGC over loopback) is taken from the "
        f"ranks' compute. The fractions are therefore of *this* machine's no-communication "
        f"rate; on real hosts compute would be faster and communication a larger share.",
        "Other work on the machine (other engineers' test suites) was not controlled. It "
        "shows in the ranks' CPU share: with nothing else running the 4 ranks use ~97-99% "
        f"of the {os.cpu_count()} cores in every method, also the communication-bound ones: "
        "a rank waiting for a collective spins (strace of a dense ResNet-18 rank at "
        "100 Mbit/s RTT 50 ms: 72,529 sched_yield calls in 3 s over its threads, while it waited on the link), so "
        "on oversubscribed cores waiting ranks take CPU from computing ones. A launch below --min-share "
        f"({args.min_share:.0%}) was measured again after {args.retry_wait:g} s (up to "
        f"{args.retries} time(s)), the attempt with the highest share kept; rows still below "
        "are marked **contended** and their rates (and fractions) are not the method's. "
        "The load average at the start and end of each launch is in the CSV.",
        "The no-communication ranks start together at a file barrier (the hosts share one "
        "file system) and never use the network: the upper bound for any method here.",
        "At 1 Gbit/s the emulator's forwarder (one Python process, on the same 2 cores as "
        "the ranks) may fall short of the nominal rate; bytes on the wire are measured, "
        "time is what it is.",
        "Dense rows: Horovod's Gloo allreduce is a ring over ranks 0-1 (h1) and 2-3 (h2), so "
        "one ring edge crosses each way, carrying 2(N-1)/N of the fused gradient.",
        "DGC rows: density 0.001 from the first step (no warm-up), the steady state. Flat "
        "DGC's cost model chose the paths listed in the status column (counts over all "
        "ranks and steps, warm-up included); small tensors (< 1024 elements: biases, "
        "batch norm) go dense in every DGC method, and across hosts in all of them.",
        "DGA rows: delay=2, so a step waits for the collectives of two steps earlier; "
        "`opt.flush()` after the timed steps is timed apart (status column).",
        "One launch per cell, no repetitions (see the noise note below).",
    ]
    session = meta["date"]
    if args.report_only:
        rows = load_previous(os.path.splitext(args.out)[0] + ".csv")
        meta["finished"] = True
        for rate, rtt in links:
            missing = [f"{wl} {LABELS[m]}" for wl in args.workloads for m in methods
                       if not any(key(r) == (wl, rate, rtt, m) for r in rows)]
            if missing:
                meta["not_run"].append(f"{rate:g} Mbit/s RTT {rtt:g} ms: " + ", ".join(missing))
        print(write_outputs(rows, meta, args))
        return
    grid = {(wl, rate, rtt, m) for rate, rtt in links for wl in args.workloads for m in methods}
    rows = []
    if args.resume:
        rows = [r for r in load_previous(os.path.splitext(args.out)[0] + ".csv")
                if key(r) in grid and r.get("status") == "ok"
                and r.get("cpu_share", 0) >= args.min_share]
        print(f"[multihost] --resume: keeping {len(rows)} uncontended rows", flush=True)
    started = time.time()
    budget = args.budget_minutes * 60
    print(f"[multihost] {len(links)} link(s) x {len(args.workloads)} workload(s) x "
          f"{len(methods)} methods; budget {args.budget_minutes:g} min", flush=True)

    def save():
        meta["wall_min"] = (time.time() - started) / 60
        return write_outputs(rows, meta, args)

    def have(cell):
        return any(key(r) == cell for r in rows)

    for rate, rtt in links:
        todo = [(wl, m) for wl in args.workloads for m in methods
                if not have((wl, rate, rtt, m))]
        if not todo:
            continue
        if time.time() - started > budget:
            meta["not_run"].append(f"{rate:g} Mbit/s RTT {rtt:g} ms: "
                                   + ", ".join(f"{wl} {LABELS[m]}" for wl, m in todo)
                                   + f" (time budget of {args.budget_minutes:g} min spent)")
            continue
        try:
            with EmulatedHosts(HOSTS, rate_mbit=rate, rtt_ms=rtt) as hosts:
                print(f"[multihost] {hosts.description}", flush=True)
                for wl, m in todo:
                    if time.time() - started > budget:
                        meta["not_run"].append(f"{WORKLOADS[wl].format(b=args.cnn_batch)}, "
                                               f"{rate:g} Mbit/s RTT {rtt:g} ms, {LABELS[m]} "
                                               f"(time budget spent)")
                        continue
                    row = measure(hosts, wl, m, rate, rtt, args)
                    attempts = 1
                    while (row["status"] == "ok" and row["cpu_share"] < args.min_share
                           and attempts <= args.retries
                           and time.time() - started < budget):
                        print(f"  {wl} {LABELS[m]}: ranks got {row['cpu_share']:.0%} of the "
                              f"cores (load {row['loadavg_start']:.1f}): again in "
                              f"{args.retry_wait:g} s", flush=True)
                        time.sleep(args.retry_wait)
                        again = measure(hosts, wl, m, rate, rtt, args)
                        attempts += 1
                        if again["status"] == "ok" and again["cpu_share"] > row["cpu_share"]:
                            row = again
                    row.update(attempts=attempts, session=session)
                    rows.append(row)
                    set_fractions(rows)
                    if row["status"] == "ok":
                        vs = f" ({row['vs_nocomm']:.0%} of no-comm)" if row.get("vs_nocomm") else ""
                        what = (f"{row['samples_per_s']:8.1f} samples/s{vs}, h1->h2 "
                                f"{mb(row.get('measured_h1_to_h2_bytes_per_step'))} MB/step, "
                                f"CPU share {row['cpu_share']:.0%}")
                    else:
                        what = f"ERROR {row['error'][:200]}"
                    print(f"  {wl:>3} {rate:>6g} Mbit/s RTT {rtt:>3g} ms  {LABELS[m]:<31} {what}"
                          f"  [{row['launch_s']} s launch, load {row['loadavg_start']:.1f}, "
                          f"{(time.time() - started) / 60:.1f} min so far]", flush=True)
                    save()
        except (HostsError, OSError) as exc:
            for wl, m in todo:
                if not any((r["workload"], r["rate_mbit"], r["rtt_ms"], r["method"])
                           == (wl, rate, rtt, m) for r in rows):
                    rows.append({"workload": wl, "rate_mbit": rate, "rtt_ms": rtt, "method": m,
                                 "label": LABELS[m], "status": "error",
                                 "error": f"emulated hosts: {exc}"[:300]})
    meta["finished"] = True
    print(save())


if __name__ == "__main__":
    main()
