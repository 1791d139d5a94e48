"""How long a TensorFlow step takes to trace and to its first run, hvd_dgc's tape against
stock Horovod's, on 2 ranks over loopback.

A traced TensorFlow step holds every density stage's paths of every compressed tensor in
one graph, so the first step of a large model with the warm-up on is long (Horovod's
own tensorflow2_synthetic_benchmark.py on MobileNetV2, 158 tensors: minutes on a CPU).
This measures it on a synthetic model: ``--tensors`` tensors of 50,000 elements and as
many of 100, a loss ``sum(v * v)``, SGD, ``hvd.DistributedGradientTape`` inside a
``tf.function``, the link assumed slow so that the large tensors are compressed
(``HVD_DGC_COST_MODEL=assumed``). Each row: the seconds to trace the step
(``get_concrete_function``), to its first run (TensorFlow prepares the graph) and a step
afterwards, the graph's operations (its functions' included), for stock Horovod and
hvd_dgc (default warm-up: 5 density stages; ``warmup=0``: one), measured one after the
other in this run.

    python bench/tf_trace.py                 # --tensors 10
    python bench/tf_trace.py --tensors 20 --out bench/results/tf_trace.md
"""

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

LARGE, SMALL = 50_000, 100


def measure(which="hvd_dgc", tensors=10, warmup=None, steps=10):
    """One rank's trace, first-run and step times (run under horovodrun)."""
    import tensorflow as tf
    if which == "horovod":
        import horovod.tensorflow as hvd
    else:
        import hvd_dgc.tensorflow as hvd
    hvd.init()
    options = {} if which == "horovod" or warmup is None else {"warmup": warmup}
    variables = [tf.Variable(tf.random.normal([size], seed=i), name=f"v{i}_{size}")
                 for size in (LARGE, SMALL) for i in range(tensors)]
    opt = tf.optimizers.SGD(0.01)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(v * v) for v in variables])
        tape = hvd.DistributedGradientTape(tape, **options)
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))

    start = time.perf_counter()
    graph = step.get_concrete_function().graph.as_graph_def()
    traced = time.perf_counter()
    step()
    first = time.perf_counter()
    for _ in range(steps):
        step()
    done = time.perf_counter()
    return {"trace_s": traced - start, "first_run_s": first - traced,
            "step_ms": (done - first) / steps * 1000,
            "ops": len(graph.node) + sum(len(f.node_def) for f in graph.library.function)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=10,
                        help="large tensors (and as many small ones)")
    parser.add_argument("--out", help="also write the table to this markdown file")
    args = parser.parse_args()
    from harness.hvdrun import run
    env = {"HVD_DGC_COST_MODEL": "assumed", "TF_USE_LEGACY_KERAS": "1"}
    rows = [("Horovod", "horovod", None), ("hvd_dgc, default warm-up", "hvd_dgc", None),
            ("hvd_dgc, warmup=0", "hvd_dgc", 0)]
    lines = [f"{args.tensors} tensors of {LARGE:,} elements and {args.tensors} of {SMALL}, "
             f"2 ranks (gloo), the link assumed slow; seconds on rank 0.", "",
             "| step | trace s | first run s | step ms | graph ops | trace vs Horovod |",
             "|---|---|---|---|---|---|"]
    base = None
    for label, which, warmup in rows:
        got = run("bench.tf_trace:measure", np=2, env=env, timeout=1800,
                  kwargs={"which": which, "tensors": args.tensors, "warmup": warmup})[0]
        base = base or got["trace_s"]
        lines.append(f"| {label} | {got['trace_s']:.1f} | {got['first_run_s']:.1f} | "
                     f"{got['step_ms']:.0f} | {got['ops']:,} | "
                     f"{got['trace_s'] / base:.1f}x |")
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
