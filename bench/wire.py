"""Bytes on the wire per rank and step: hvd_dgc's modes on ResNet-50's and the stdlib byte
LM's parameter shapes, at 2 to 1,024 ranks, and real runs to check the simulation.

    python bench/wire.py                 # the simulated table, N = 2 ... 1024
    python bench/wire.py --csv           # n_workers,mode,bytes_received_per_rank,...
    python bench/wire.py --real          # real runs at 2 and 4 ranks beside the simulation
    python bench/wire.py --real --np 2 --models resnet50
    python bench/wire.py --real --np 8 --hosts 2   # 2 emulated hosts x 4 ranks, over ssh
    python bench/wire.py --tensorflow    # TensorFlow's tape beside PyTorch, DGC's defaults

The simulation (harness/wire_sim.py) takes the planner's own choices (paths, buckets, the
dense tensors riding in an allgather) with the cost model's assumed 1 Gbit/s link, and
the wire formats' sizes, which the encoders write (tests/core/test_wire_code.py); no rank
runs. ``--real`` runs each mode under ``horovodrun --gloo`` on this host (harness/wire.py,
synthetic gradients, DGC at 0.001 from the first step; ``adamw_default``: AdamW with no
option, its exchange after the freeze): a rank's bytes sent are hvd_dgc's
own count (``compression_stats()["last_step"]``), received are priced from each tensor's
path; and prints the simulation's numbers for the same N beside them. With ``--hosts H``
the ranks are spread over H emulated hosts (harness/hosts.py: network namespaces with a
real sshd), horovodrun started on the first and reaching the others over ssh, as on a
cluster; the planner then sees H hosts. ``--tensorflow`` runs DGC's defaults
(``sgd_dgc``) through TensorFlow's tape and PyTorch's optimizer side by side, each rank's
bytes sent a step as hvd_dgc counts them, beside the simulation's.
"""

import argparse
import contextlib
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from harness import wire_sim  # noqa: E402
from harness.wire import MODES, QUIET, payload  # noqa: E402

WORLDS = [2, 4, 8, 16, 64, 256, 1024]
COLUMNS = ["n_workers", "mode", "bytes_received_per_rank", "dense_bytes_per_rank", "model",
           "bytes_sent_per_rank", "fewer_than_dense_received", "paths"]


def _paths(paths):
    return " ".join(f"{k}:{v}" for k, v in sorted(paths.items()))


def simulated(models, modes, worlds):
    rows = []
    for model in models:
        for mode in modes:
            for world in worlds:
                r = wire_sim.step_bytes(model, mode, world)
                rows.append((world, mode, round(r["received"]), round(r["dense_received"]),
                             model, round(r["sent"]), r["dense_received"] / r["received"],
                             _paths(r["paths"])))
    return rows


def _hosts(world, hosts):
    """``hosts`` emulated hosts sharing ``world`` ranks (1: this host alone, loopback)."""
    if hosts == 1:
        return contextlib.nullcontext()
    from harness.hosts import EmulatedHosts
    return EmulatedHosts([f"h{h + 1}:{world // hosts + (h < world % hosts)}"
                          for h in range(hosts)])


def real(models, modes, worlds, hosts=1):
    from harness.hvdrun import run
    print("| model | N | hosts | mode | sent a step | received a step | simulated received | "
          "difference | dense ring's | fewer than dense fp32 sent | paths | across the "
          "link, each way | its difference | a barrier's |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for model in models:
        for world in worlds:
            for mode in modes:
                with _hosts(world, hosts) as on:
                    r = run("harness.wire:step_bytes", np=world, timeout=900, hosts=on,
                            kwargs={"model": model, "mode": mode}, env=QUIET)[0]
                sim = wire_sim.step_bytes(model, mode, world)["received"] \
                    if mode in wire_sim.MODES else None
                diff = f"{100 * (sim / r['received'] - 1):+.2f}%" if sim else "-"
                print(f"| {model} | {world} | {hosts} | {mode} | {round(r['sent']):,} | "
                      f"{round(r['received']):,} | "
                      f"{f'{round(sim):,}' if sim else '-'} | {diff} | "
                      f"{round(r['dense_received']):,} | "
                      f"{r['dense_sent'] / r['sent']:.0f}x | {_paths(r['paths'])} | "
                      f"{_across(r, sim)} |", flush=True)


def tensorflow(models, worlds):
    """DGC's defaults through TensorFlow's tape and PyTorch's optimizer: a rank's bytes
    sent in a step (hvd_dgc's counts), beside the simulation's."""
    from harness.hvdrun import run
    print("| model | N | TensorFlow sent a step | PyTorch sent a step | simulated | "
          "TensorFlow / PyTorch | fewer than dense fp32 (TensorFlow) | TensorFlow's paths |")
    print("|---|---|---|---|---|---|---|---|")
    for model in models:
        for world in worlds:
            tf = run("harness.wire:tf_step_bytes", np=world, timeout=900,
                     kwargs={"model": model}, env=QUIET)[0]
            pt = run("harness.wire:step_bytes", np=world, timeout=900,
                     kwargs={"model": model, "mode": "sgd_dgc"}, env=QUIET)[0]
            sim = wire_sim.step_bytes(model, "sgd_dgc", world)["sent"]
            print(f"| {model} | {world} | {round(tf['sent']):,} | {round(pt['sent']):,} | "
                  f"{round(sim):,} | {tf['sent'] / pt['sent']:.4f} | "
                  f"{tf['dense_sent'] / tf['sent']:.0f}x | {_paths(tf['paths'])} |",
                  flush=True)


def _across(r, sim):
    """The TCP payload that crossed the first host's link in the step, each way; where
    every tensor rode an allgather, or the two hosts hold a rank each, its difference
    from the simulation's received bytes (Gloo's ring passes all blocks but one each way
    across a cut between two hosts of consecutive ranks: what one rank receives; for
    AdamW an exchange's, the simulation's step times the period); and what a barrier
    alone (a 4-byte allreduce, Horovod's negotiation included) sent across, which the
    step's counters are taken net of."""
    link = r.get("link")
    if not link:
        return "- | - | -"
    sent, got = payload(link)
    ring = sim and (r["world"] == 2 or set(r["paths"]) <= {"sparse", "dense"} and r["folded"])
    sim = sim and sim * r["period"]  # (the link's bytes are an exchange's, undivided)
    return f"{sent:,} / {got:,} | " + \
        (f"{100 * (sent / sim - 1):+.2f}% / {100 * (got / sim - 1):+.2f}%" if ring else "-") + \
        " | {:,} / {:,}".format(*payload(link["barrier"]))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--np", type=int, nargs="+", default=None,
                        help=f"ranks (default: {WORLDS}; with --real, 2 4)")
    parser.add_argument("--models", nargs="+", default=["resnet50", "stdlib_lm"],
                        choices=["resnet50", "stdlib_lm"])
    parser.add_argument("--modes", nargs="+", default=None,
                        help=f"simulated: {list(wire_sim.MODES)}; real: {list(MODES)}")
    parser.add_argument("--real", action="store_true", help="real runs beside the simulation")
    parser.add_argument("--hosts", type=int, default=1,
                        help="with --real: the ranks spread over this many emulated hosts "
                             "(harness/hosts.py), horovodrun reaching them over ssh")
    parser.add_argument("--tensorflow", action="store_true",
                        help="TensorFlow's bytes beside PyTorch's (default: 2 ranks)")
    parser.add_argument("--csv", action="store_true")
    args = parser.parse_args()
    if args.tensorflow:
        tensorflow(args.models, args.np or [2])
        return
    if args.real:
        real(args.models, args.modes or list(MODES), args.np or [2, 4], args.hosts)
        return
    rows = simulated(args.models, args.modes or list(wire_sim.MODES), args.np or WORLDS)
    if args.csv:
        print(",".join(COLUMNS))
        for row in rows:
            print(",".join(f"{v:.1f}" if isinstance(v, float) else str(v) for v in row))
        return
    print("| model | mode | N | received a step | dense ring's | fewer than dense | sent a "
          "step | paths |")
    print("|---|---|---|---|---|---|---|---|")
    for world, mode, received, dense, model, sent, ratio, paths in rows:
        print(f"| {model} | {mode} | {world} | {received:,} | {dense:,} | {ratio:.1f}x | "
              f"{sent:,} | {paths} |")


if __name__ == "__main__":
    main()
