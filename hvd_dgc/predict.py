"""``python -m hvd_dgc.predict``: what hvd_dgc would do for a model on a link, before the
cluster.

    python -m hvd_dgc.predict --model ResNet50 --np 8 --hosts 2 --link 1gbit
    python -m hvd_dgc.predict --model mypkg.models:build --np 4 -H a:2,b:2 \\
        --rate-mbit 100 --rtt-ms 20 --optimizer adamw --step-ms 250 --json

For each warm-up stage it prints what each tensor would do (grouped), the bytes one
rank sends per step, the predicted step time against Horovod's dense allreduce, and the
options and ``horovodrun`` config it recommends.

This module is the command line and its report only. The decisions are the optimizer's
own: the options resolved by ``DGCConfig.resolve``, the ``Planner`` of hvd_dgc/plan.py
built as hvd_dgc/torch/optimizer.py builds it, fed a ``LinkMeasurement``
(hvd_dgc/linkprobe.py) made from the link given here instead of the probe's timings,
and DGC's own work on this machine measured by the optimizer's calibration
(hvd_dgc/torch/link.py ``measure_local``, agreed over one process instead of the ranks).
No Horovod job is started; TensorFlow is imported only for a Keras model.

What it predicts is the cost model's sums' plan (the plan every rank starts with). A
job with the default ``cost_model="measure"`` then times the link itself and, in
PyTorch, may try a plan laid on the backward pass's timeline against it
(hvd_dgc/overlap.py); Keras may try every tensor dense (plan_trial.py). The step time is
``compute + DGC's local work + the exchange`` (no overlap with the backward pass; with
``delay=D`` the exchange hides behind D steps of compute; with ``period=p`` one step in
p exchanges), and Horovod's ``compute + its dense allreduce`` in ``ceil(bytes / fusion
threshold)`` fused operations, both priced by the same cost model
(``Planner.exchange_seconds``). docs/predict.md says how close it came to the measured
runs in bench/results.
"""

import argparse
import contextlib
import importlib
import importlib.util
import json
import math
import os
import re
import statistics
import sys
import time

__all__ = ["main", "link_measurement", "parse_hosts", "LINKS"]

#: ``--link`` names: (Mbit/s, RTT ms).
LINKS = {"100mbit": (100.0, 0.0), "1gbit": (1000.0, 0.0), "10gbit": (10000.0, 0.0),
         "25gbit": (25000.0, 0.0), "100gbit": (100000.0, 0.0),
         "wan": (100.0, 50.0), "cross-region": (50.0, 150.0)}

#: Seconds per message the probe read on emulated links at RTT 0 (Horovod's negotiation
#: and cycle: 363-667 us on 2 ranks, bench/results/never_slower.md), and per millisecond
#: of round trip (75.4-75.5 ms per message at RTT 50 ms there: 1.5 round trips).
MESSAGE_SECONDS, RTT_MESSAGES = 500e-6, 1.5
#: Horovod's allgather, which carries DGC's records, moved bytes at about half its ring
#: allreduce's rate over TCP (bench/results/collective_rates.md; the probe read 410 of
#: 789 and 45 of 90 Mbit/s): the records' rate unless --gather-mbit says otherwise.
GATHER_SHARE = 0.5
#: The forward and backward passes timed for the compute of a step.
TIMED_STEPS = 3

OPTIMIZERS = ("sgd", "adam", "adamw")
CONFIGS = {"wan": "horovodrun_configs/wan_cross_region.yaml",
           "cheap": "horovodrun_configs/cheap_1gbe.yaml",
           "datacenter": "horovodrun_configs/datacenter_25gbe.yaml"}


# -- arguments --------------------------------------------------------------------------
def _parser():
    p = argparse.ArgumentParser(
        prog="python -m hvd_dgc.predict",
        description="What hvd_dgc would do for a model on a link: each warm-up stage's "
                    "paths, bytes per step and step time against Horovod's, and the "
                    "options and horovodrun config to use. No Horovod job is started.")
    p.add_argument("--model", required=True,
                   help="a torchvision model name or Keras application name (where "
                        "installed), or module:function returning a torch.nn.Module or a "
                        "Keras model")
    p.add_argument("--np", type=int, default=None, help="number of ranks (world size)")
    p.add_argument("--hosts", type=int, default=None,
                   help="number of hosts the ranks are spread over evenly (default 1)")
    p.add_argument("-H", dest="host_list", default=None,
                   help="hosts as horovodrun takes them: host1:4,host2:4")
    link = p.add_argument_group("the link between hosts")
    link.add_argument("--link", default=None, choices=sorted(LINKS),
                      help="a named link (Mbit/s, RTT): " + ", ".join(
                          f"{k} = {r:g} Mbit/s RTT {t:g} ms" for k, (r, t) in LINKS.items()))
    link.add_argument("--rate-mbit", type=float, default=None, help="link rate, Mbit/s")
    link.add_argument("--rtt-ms", type=float, default=None, help="round trip, ms (default 0)")
    link.add_argument("--alpha-us", type=float, default=None,
                      help="seconds per message, in us, as the probe would read it "
                           f"(default {MESSAGE_SECONDS * 1e6:.0f} us + {RTT_MESSAGES:g} RTT)")
    link.add_argument("--gather-mbit", type=float, default=None,
                      help="rate of the records' allgather, Mbit/s (default "
                           f"{GATHER_SHARE:g}x the link rate)")
    opt = p.add_argument_group("the optimizer and hvd_dgc's options")
    opt.add_argument("--optimizer", default="sgd", choices=OPTIMIZERS)
    opt.add_argument("--density", type=float, default=None)
    opt.add_argument("--warmup", type=float, default=None)
    opt.add_argument("--warmup-unit", default=None, choices=("epoch", "step"))
    opt.add_argument("--delay", default=None, help="an int, or auto")
    opt.add_argument("--period", type=int, default=None)
    opt.add_argument("--aggregation", default=None)
    opt.add_argument("--min-compress-size", type=int, default=None)
    opt.add_argument("--fusion-threshold-mb", type=float, default=None)
    step = p.add_argument_group("a step's compute")
    step.add_argument("--step-ms", type=float, default=None,
                      help="compute time of one step (forward and backward), ms; default: "
                           "measured here on synthetic input")
    step.add_argument("--batch-size", type=int, default=32,
                      help="batch per rank for the measured step (default 32)")
    step.add_argument("--input-shape", default=None,
                      help="one sample's shape, e.g. 3,224,224 (default: the model's)")
    step.add_argument("--local-cost", default="measure", choices=("measure", "none"),
                      help="DGC's own selection work: measured here as the optimizer "
                           "measures it (default), or none (the link alone)")
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print one JSON object")
    out.add_argument("--per-tensor", action="store_true",
                     help="list every tensor's path per stage")
    return p


def parse_hosts(text):
    """``host1:4,host2:4`` -> [("host1", 4), ("host2", 4)]; ValueError saying what is
    wrong."""
    hosts = []
    for part in text.split(","):
        name, _, slots = part.strip().partition(":")
        if not name:
            raise ValueError(f"{part!r} has no host name")
        try:
            count = int(slots) if slots else 1
        except ValueError:
            raise ValueError(f"{part!r}: slots must be a whole number") from None
        if count < 1:
            raise ValueError(f"{part!r}: slots must be >= 1")
        hosts.append((name, count))
    return hosts


def _world(args, p):
    """(np, hosts, slots per host, the -H text)."""
    if args.host_list is not None:
        try:
            listed = parse_hosts(args.host_list)
        except ValueError as e:
            p.error(f"argument -H: {e} (write it as horovodrun takes it: -H host1:4,host2:4)")
        np_ = args.np if args.np is not None else sum(c for _, c in listed)
        if args.np is not None and args.np != sum(c for _, c in listed):
            p.error(f"argument --np: {args.np} ranks, but -H {args.host_list} has "
                    f"{sum(c for _, c in listed)} slots; make them agree (or leave --np "
                    f"out)")
        if args.hosts is not None and args.hosts != len(listed):
            p.error(f"argument --hosts: {args.hosts}, but -H names {len(listed)} hosts; "
                    f"give one of the two")
        if len({c for _, c in listed}) > 1:
            p.error(f"argument -H: {args.host_list} has hosts of different sizes; this "
                    f"prediction needs the same number of ranks on each host")
        return np_, len(listed), listed[0][1], args.host_list
    if args.np is None:
        p.error("argument --np: the number of ranks is required (--np 8 --hosts 2, or "
                "-H host1:4,host2:4)")
    if args.np < 1:
        p.error(f"argument --np: must be >= 1, got {args.np}")
    hosts = 1 if args.hosts is None else args.hosts
    if hosts < 1:
        p.error(f"argument --hosts: must be >= 1, got {hosts}")
    if args.np % hosts:
        p.error(f"argument --hosts: {hosts} hosts do not divide --np {args.np}; give a "
                f"number of hosts that holds the same number of ranks each")
    slots = args.np // hosts
    return args.np, hosts, slots, ",".join(f"host{i + 1}:{slots}" for i in range(hosts))


def _link(args, p):
    """(rate Mbit/s, RTT ms, alpha s, gather Mbit/s)."""
    rate, rtt = LINKS[args.link] if args.link else (None, 0.0)
    if args.rate_mbit is not None:
        rate = args.rate_mbit
    if args.rtt_ms is not None:
        rtt = args.rtt_ms
    if rate is None:
        p.error("argument --rate-mbit: the link is required: --link 1gbit, or --rate-mbit "
                "1000 --rtt-ms 0.5")
    if not rate > 0 or not math.isfinite(rate):
        p.error(f"argument --rate-mbit: the link rate must be > 0 Mbit/s, got {rate:g}")
    if not rtt >= 0 or not math.isfinite(rtt):
        p.error(f"argument --rtt-ms: the round trip must be >= 0 ms, got {rtt:g}")
    alpha = MESSAGE_SECONDS + RTT_MESSAGES * rtt / 1000 if args.alpha_us is None \
        else args.alpha_us / 1e6
    if not alpha >= 0:
        p.error(f"argument --alpha-us: must be >= 0 us, got {args.alpha_us:g}")
    gather = GATHER_SHARE * rate if args.gather_mbit is None else args.gather_mbit
    if not gather > 0:
        p.error(f"argument --gather-mbit: must be > 0 Mbit/s, got {gather:g}")
    return rate, rtt, alpha, gather


def link_measurement(rate_mbit, alpha, gather_mbit):
    """The ``LinkMeasurement`` the probe would have made of this link (the optimizer's own
    object: ``cost_model()`` is what the planner prices with)."""
    from hvd_dgc.linkprobe import LinkMeasurement
    return LinkMeasurement(alpha=alpha, bandwidth=rate_mbit * 1e6 / 8, seconds=0.0,
                           largest=0, gather_bandwidth=gather_mbit * 1e6 / 8)


def _options(args, p):
    """hvd_dgc's options the command line gives, each checked by DGCConfig alone first so
    the error names its argument."""
    from hvd_dgc.config import DGCConfig
    given = {"density": args.density, "warmup": args.warmup,
             "warmup_unit": args.warmup_unit, "period": args.period,
             "aggregation": args.aggregation, "min_compress_size": args.min_compress_size}
    if args.delay is not None:
        given["delay"] = "auto" if args.delay == "auto" else _int(args.delay, "--delay", p)
    if args.fusion_threshold_mb is not None:
        if args.fusion_threshold_mb < 0:
            p.error(f"argument --fusion-threshold-mb: must be >= 0, got "
                    f"{args.fusion_threshold_mb:g}")
        given["fusion_threshold"] = int(args.fusion_threshold_mb * 1024 * 1024)
    options = {k: v for k, v in given.items() if v is not None}
    for name, value in options.items():
        try:
            DGCConfig.from_options({name: value}, "torch", "python -m hvd_dgc.predict")
        except (TypeError, ValueError) as e:
            p.error(f"argument --{name.replace('_', '-')}: {e}")
    try:
        config = DGCConfig.from_options(options, "torch", "python -m hvd_dgc.predict")
    except (TypeError, ValueError) as e:
        p.error(f"hvd_dgc's options: {e}")
    return options, config


def _int(text, name, p):
    try:
        return int(text)
    except ValueError:
        p.error(f"argument {name}: expected a whole number or auto, got {text!r}")


# -- the model --------------------------------------------------------------------------
def _installed(name):
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


#: TensorFlow's start-up lines (absl's, oneDNN's, CUDA's): held back from stderr.
TF_NOISE = re.compile(r"^(WARNING: All log messages before absl|[IWE]\d{4} )")


@contextlib.contextmanager
def _tf_quiet():
    """Import and build TensorFlow with its start-up lines kept off stderr (every other
    line passes; ``TF_CPP_MIN_LOG_LEVEL=0`` shows them all)."""
    if os.environ.get("TF_CPP_MIN_LOG_LEVEL", "").strip() == "0":
        yield
        return
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tempfile
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = [line for line in held.read().decode(errors="replace").splitlines()
                    if not TF_NOISE.match(line)]
            if kept:
                print("\n".join(kept), file=sys.stderr)


def _keras_applications():
    import keras
    return {n: getattr(keras.applications, n) for n in dir(keras.applications)
            if n[:1].isupper() and callable(getattr(keras.applications, n))}


def _load_model(spec, p):
    """(model, "torch" or "keras", description)."""
    if ":" in spec:
        module_name, _, function = spec.partition(":")
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            p.error(f"argument --model: cannot import {module_name!r} ({e}); give "
                    f"module:function with the module importable from here")
        fn = getattr(module, function, None)
        if not callable(fn):
            p.error(f"argument --model: {module_name} has no function {function!r}")
        model = fn()
        kind = _kind(model)
        if kind is None:
            p.error(f"argument --model: {spec} returned {type(model).__name__}, not a "
                    f"torch.nn.Module or a Keras model; return the model itself")
        return model, kind, spec
    if _installed("torchvision"):
        from torchvision import models
        names = {n.lower(): n for n in models.list_models(module=models)}
        if spec.lower() in names:
            return models.get_model(names[spec.lower()], weights=None), "torch", \
                f"{names[spec.lower()]} (torchvision)"
    available = []
    if _installed("torchvision"):
        from torchvision import models
        available += models.list_models(module=models)
    if _installed("keras") or _installed("tensorflow"):
        apps = _keras_applications()
        match = {n.lower(): n for n in apps}.get(spec.lower())
        if match:
            return apps[match](weights=None), "keras", f"{match} (Keras application)"
        available += sorted(apps)
    where = ", ".join(available) if available else \
        "none here (neither torchvision nor Keras is installed)"
    p.error(f"argument --model: unknown model {spec!r}. Named models: {where}. Or give "
            f"module:function returning a torch.nn.Module or a Keras model")


def _kind(model):
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(model, torch.nn.Module):
        return "torch"
    module = type(model).__module__ or ""
    if module.split(".")[0] in ("keras", "tf_keras", "tensorflow") and \
            hasattr(model, "trainable_variables"):
        return "keras"
    return None


def _tensors(model, kind):
    from hvd_dgc.plan import TensorInfo
    if kind == "torch":
        return [TensorInfo(i, name, p.numel(), tuple(p.shape))
                for i, (name, p) in enumerate(model.named_parameters()) if p.requires_grad]
    out = []
    for i, v in enumerate(model.trainable_variables):
        shape = tuple(int(d) for d in v.shape)
        out.append(TensorInfo(i, getattr(v, "path", None) or v.name,
                              int(math.prod(shape)), shape))
    return out


def _input_shape(model, kind, args, p):
    if args.input_shape:
        try:
            shape = tuple(int(d) for d in args.input_shape.split(","))
        except ValueError:
            shape = ()
        if not shape or min(shape) < 1:
            p.error(f"argument --input-shape: expected sizes like 3,224,224, got "
                    f"{args.input_shape!r}")
        return shape
    if kind == "keras":
        shape = tuple(model.input_shape[1:])
        if all(d for d in shape):
            return shape
    else:
        import torch
        first = next((m for m in model.modules()
                      if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))), None)
        if isinstance(first, torch.nn.Linear):
            return (first.in_features,)
    p.error("argument --input-shape: this model's input shape is not known here; give "
            "--input-shape (e.g. 3,224,224) to time a step, or --step-ms")


def _compute_seconds(model, kind, shape, batch):
    """The median of TIMED_STEPS forward and backward passes on synthetic input, after
    one not timed."""
    times = []
    if kind == "torch":
        import torch
        x = torch.randn(batch, *shape)
        for i in range(TIMED_STEPS + 1):
            start = time.perf_counter()
            out = model(x)
            out = out[0] if isinstance(out, (tuple, list)) else out
            out.float().mean().backward()
            times.append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
    else:
        import tensorflow as tf
        x = tf.random.normal((batch,) + tuple(shape))
        for i in range(TIMED_STEPS + 1):
            start = time.perf_counter()
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.cast(model(x, training=True), tf.float32))
            tape.gradient(loss, model.trainable_variables)
            times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


# -- the optimizer's planner ------------------------------------------------------------
def _framework(kind):
    """(Framework, Horovod's ops) of the wrapper that would run this model."""
    if kind == "torch":
        from horovod.torch.mpi_ops import Adasum, Average, Sum
        from hvd_dgc.torch.optimizer import TORCH
        return TORCH, (Average, Sum, Adasum)
    from horovod.tensorflow import Adasum, Average, Sum
    from hvd_dgc.tensorflow.exchange import TENSORFLOW
    return TENSORFLOW, (Average, Sum, Adasum)


def _optimizer_tuple(name):
    """What the wrappers tell ``DGCConfig.resolve`` of the wrapped optimizer: (is SGD,
    class name, is Adam or AdamW)."""
    return {"sgd": (True, "SGD", False), "adam": (False, "Adam", True),
            "adamw": (False, "AdamW", True)}[name]


def _planner(config, optimizer, kind, tensors, world, hosts, slots, link, local_cost, p):
    """The optimizer's planner for these tensors, built and measured in the order
    hvd_dgc/torch/optimizer.py builds it: resolve, Planner, the hosts, the link and
    DGC's local work, Adam's freeze, the settled options."""
    from hvd_dgc.resolve import HorovodArguments
    from hvd_dgc.plan import Planner, hierarchical_hosts
    framework, ops = _framework(kind)
    try:
        resolved = config.replace(cost_model="measure").resolve(
            framework, None, HorovodArguments(ops[0], 1.0, 1, None, ops),
            _optimizer_tuple(optimizer))
    except (TypeError, ValueError) as e:
        p.error(f"hvd_dgc's options with --optimizer {optimizer}: {e}")
    planner = Planner(resolved, tensors, world)
    unsupported = None  # (as hvd_dgc/tensorflow/parts.py says it at set-up)
    if kind == "keras" and resolved.freeze is not None:
        unsupported = "in TensorFlow it does not run with Adam's variance taken over yet"
    try:
        several = hierarchical_hosts(resolved, slots, hosts, True, False, unsupported)
    except ValueError as e:
        p.error(f"argument --aggregation: {e}")
    planner.replan(world, local_size=slots if several else 0)
    local, why = None, ""
    if world > 1 and planner.measure:
        if local_cost == "measure" and resolved.sparse and kind == "torch":
            from hvd_dgc.seam import Alone
            from hvd_dgc.torch.link import measure_local
            local = measure_local(resolved.compressor, Alone(),
                                  resolved.final_density() or 0.001, "cpu")
        elif local_cost == "measure" and resolved.sparse:
            why = "DGC's local work not measured for Keras here (--local-cost none)"
        elif local_cost == "measure" and resolved.exchange:
            why = f"{resolved.compressor.name}'s encoding work not measured here"
        planner.measured(link, local)
    planner.adam_freeze(resolved.chosen_lagging)
    planner.settled()
    return planner, local, why


def _horovod_planner(kind, tensors, world, link):
    """Horovod's step: dense averaging (``density=1.0``), priced by the same model."""
    from hvd_dgc.config import DGCConfig
    from hvd_dgc.resolve import HorovodArguments
    from hvd_dgc.plan import Planner
    framework, ops = _framework(kind)
    resolved = DGCConfig(density=1.0).resolve(
        framework, None, HorovodArguments(ops[0], 1.0, 1, None, ops), None)
    planner = Planner(resolved, tensors, world)
    planner.measured(link)
    return planner


# -- the report -------------------------------------------------------------------------
NEVER = 2 ** 62  # a step past every start (as PlanWords.brief asks)


def _stages(planner):
    """[(label, start, end, unit, density, step)] of the resolved schedule: exact Adam
    before its freeze, the warm-up's stages, the final density."""
    from hvd_dgc.schedule import DensitySchedule
    r = planner.resolved
    schedule = r.schedule
    inner = getattr(schedule, "inner", schedule)
    freeze = r.freeze if r.freeze is not None and not planner.adam.declined else None
    out = []
    if freeze:
        out.append(("exact Adam", 0, freeze, "step", schedule(0, 0), 0))
    if not r.sparse or not isinstance(inner, DensitySchedule) or inner.warmup <= 0:
        density = inner.density if isinstance(inner, DensitySchedule) else 1.0
        out.append(("", freeze or 0, None, "step", density, NEVER))
        return out
    shift = freeze if freeze and inner.unit == "step" else 0
    starts = (0.0,) + inner.boundaries[:-1]
    for start, end, density in zip(starts, inner.boundaries, inner.warmup_densities):
        out.append(("", start + shift, end + shift, inner.unit, density, NEVER))
    out.append(("", inner.warmup + shift, None, inner.unit, inner.density, NEVER))
    return out


def _label(start, end, unit, note):
    def n(x):
        return f"{x:,.0f}" if float(x).is_integer() else f"{x:g}"
    span = f"{unit}s {n(start)}-{n(end)}" if end is not None else f"from {unit} {n(start)}"
    return f"{span} ({note})" if note else span


def _why(planner, tensor, path, density, step, note=""):
    from hvd_dgc.paths import PathKind
    if path != PathKind.DENSE:
        return {PathKind.ALLGATHER: "sparse via allgather",
                PathKind.REGION: "sparse via region reduce",
                PathKind.HIERARCHICAL: "sparse, hierarchical (summed inside each host)",
                PathKind.EXCHANGE: f"through {planner.compressor.name}",
                PathKind.SPARSE_GRAD: "sparse gradient as Horovod sends it"}.get(path, path)
    if not planner.large(tensor):
        return f"dense (< {planner.min_compress_size} elements)"
    if planner.resolved.kind == "dense":
        return "dense (density 1: dense averaging)"
    if note == "exact Adam" or planner.exact_adam(step) or planner.adam.declined or \
            density in planner.adam.dense:
        return "dense (exact Adam)"
    if density >= 1:
        return "dense (everything selected)"
    return "dense (cheaper than sparse on this link)"


def _wire_bytes(planner, tensor, path, density):
    """Bytes one rank receives for ``tensor`` on ``path`` in one exchange
    (prices.py ``Prices.wire_bytes``)."""
    return planner.prices.wire_bytes(tensor.numel, planner.k(tensor, density), path)


def _local_seconds(planner, tensor, path, density):
    """DGC's (or a payload compressor's) own work on ``tensor``, as the cost model
    charges it."""
    from hvd_dgc.paths import PathKind
    model, world = planner.cost_model, planner.world_size
    if path.sums_records if isinstance(path, PathKind) else False:
        return model.local_seconds(tensor.numel, planner.k(tensor, density), world)
    if path == PathKind.EXCHANGE:
        return tensor.numel * (model.encode_element_seconds +
                               world * model.decode_element_seconds)
    return 0.0


def _launches(planner, density, threshold):
    """Horovod operations a step starts: hvd_dgc's buckets (Planner.buckets, tensors in
    backward order), each other tensor alone."""
    order = list(reversed(planner.tensors))
    buckets = planner.buckets(density, order, threshold)
    return len(set(buckets.values())) + sum(t.key not in buckets for t in planner.tensors)


def _stage(planner, tensors, stage, threshold, compute, horovod_step, hiding, period):
    """One stage of the schedule as ``predict`` reports it: each tensor's path and why,
    the bytes, the launches and the step's time against Horovod's (``hiding`` steps of
    compute hide the exchange: delayed averaging)."""
    note, start, end, unit, density, step = stage
    world = planner.world_size
    paths = {t.name: planner.path(t, density, step) for t in tensors}
    groups = {}
    for t in tensors:
        why = _why(planner, t, paths[t.name], density, step, note)
        groups[why] = groups.get(why, 0) + 1
    sent = sum(_wire_bytes(planner, t, paths[t.name], density) for t in tensors) \
        if world > 1 else 0.0
    work = sum(_local_seconds(planner, t, paths[t.name], density) for t in tensors) \
        if world > 1 else 0.0
    launches = _launches(planner, density, threshold)
    exchange = planner.exchange_seconds(density, launches, step=step) if world > 1 else 0.0
    busy = compute + work
    every = period if note != "exact Adam" else 1
    step_seconds = busy + max(0.0, exchange - hiding * busy) / every
    return {
        "stage": _label(start, end, unit, note), "from": start, "to": end, "unit": unit,
        "density": density, "paths": {n: str(v) for n, v in paths.items()},
        "groups": groups, "bytes_per_exchange": sent, "exchange_every": every,
        "bytes_per_step": sent / every, "launches": launches,
        "exchange_seconds": exchange, "local_seconds": work,
        "step_seconds": step_seconds, "horovod_step_seconds": horovod_step,
        "speedup": horovod_step / step_seconds if step_seconds > 0 else 1.0}


def _compute(model, kind, args, p):
    """``(seconds, how)``: a step's forward and backward, as given (``--step-ms``) or
    measured here on a batch of ``--batch-size``."""
    if args.step_ms is not None:
        return args.step_ms / 1000, "given"
    shape = _input_shape(model, kind, args, p)
    return _compute_seconds(model, kind, shape, args.batch_size), (
        f"measured here: forward and backward of a batch of {args.batch_size} x "
        f"{shape}, median of {TIMED_STEPS}")


def predict(args, p):
    """The whole prediction as a dict (what --json prints)."""
    from hvd_dgc.fusion import fusion_threshold
    from hvd_dgc.plan_words import PlanWords
    world, hosts, slots, host_text = _world(args, p)
    rate, rtt, alpha, gather = _link(args, p)
    if args.step_ms is not None and not args.step_ms >= 0:
        p.error(f"argument --step-ms: must be >= 0 ms, got {args.step_ms:g}")
    if args.batch_size < 1:
        p.error(f"argument --batch-size: must be >= 1, got {args.batch_size}")
    options, config = _options(args, p)
    model, kind, description = _load_model(args.model, p)
    tensors = _tensors(model, kind)
    if not tensors:
        p.error(f"argument --model: {args.model} has no trainable parameters")
    compute, how = _compute(model, kind, args, p)
    link = link_measurement(rate, alpha, gather)
    planner, local, unmeasured = _planner(config, args.optimizer, kind, tensors, world,
                                          hosts, slots, link, args.local_cost, p)
    horovod = _horovod_planner(kind, tensors, world, link)
    threshold = fusion_threshold(planner.config.fusion_threshold)
    dense_total = sum(_wire_bytes(horovod, t, "dense", 1.0) for t in tensors)
    fused = max(1, math.ceil(sum(t.numel * 4 for t in tensors) / threshold)) \
        if threshold else len(tensors)
    horovod_exchange = horovod.exchange_seconds(1.0, fused) if world > 1 else 0.0
    horovod_step = compute + horovod_exchange
    delay = planner.config.fixed_delay
    auto = planner.config.auto_delay is not None
    period = planner.config.period
    stages = [_stage(planner, tensors, stage, threshold, compute, horovod_step,
                     8 if auto else delay, period) for stage in _stages(planner)]
    out = {
        "model": description, "framework": kind, "parameters": sum(t.numel for t in tensors),
        "tensors": len(tensors), "np": world, "hosts": hosts, "ranks_per_host": slots,
        "hierarchical": bool(planner.local_size),
        "link": {"rate_mbit": rate, "rtt_ms": rtt, "alpha_us": alpha * 1e6,
                 "gather_mbit": gather},
        "cost_model": repr(planner.cost_model),
        "local_cost": None if local is None else local._asdict(),
        "local_cost_words": local.words() if local is not None else unmeasured,
        "optimizer": args.optimizer, "options": options,
        "resolved": {"compressor": PlanWords(planner).kind_name(),
                     "delay": "auto" if auto else delay,
                     "period": period, "freeze": planner.resolved.freeze,
                     "adam_declined": planner.adam.declined},
        "compute_seconds": compute, "compute_how": how,
        "horovod": {"bytes_per_step": dense_total, "launches": fused,
                    "exchange_seconds": horovod_exchange, "step_seconds": horovod_step},
        "stages": stages,
    }
    out["recommend"] = _recommend(out, host_text)
    slow = [s for s in stages if s["speedup"] < 0.95]
    if slow and out["hierarchical"] and args.aggregation is None:
        _flat_instead(out, slow, predict(argparse.Namespace(
            **dict(vars(args), aggregation="flat", step_ms=compute * 1000)), p))
    return out


def _flat_instead(out, slow, flat):
    """Hierarchical DGC is chosen per tensor for the final density and kept through the
    warm-up (plan.py ``hierarchical``): where that makes warm-up stages slower than
    Horovod, ``aggregation="flat"``'s prediction beside it, recommended where it is
    faster there and about as fast after."""
    worst = min(s["speedup"] for s in slow)
    names = {s["stage"] for s in slow}
    flat_slow = [s["speedup"] for s in flat["stages"] if s["stage"] in names]
    flat_final = flat["stages"][-1]["speedup"]
    if min(flat_slow) <= worst or flat_final < 0.9 * out["stages"][-1]["speedup"]:
        return
    rec = out["recommend"]
    rec["options"]["aggregation"] = "flat"
    rec["why"].insert(0, f"{len(slow)} warm-up stage(s) predicted slower than Horovod "
                         f"({worst:.2f}x at worst): hierarchical DGC is chosen for the "
                         f"final density and kept through the warm-up; aggregation='flat' "
                         f"is predicted {min(flat_slow):.2f}x at worst there and "
                         f"{flat_final:.2f}x after the warm-up")


def _recommend(out, host_text):
    """The horovodrun config for the link and the options for the predicted steps."""
    link, final = out["link"], out["stages"][-1]
    if link["rtt_ms"] >= 20 or link["rate_mbit"] < 100:
        config = CONFIGS["wan"]
    elif link["rate_mbit"] >= 10000 and link["rtt_ms"] < 1:
        config = CONFIGS["datacenter"]
    else:
        config = CONFIGS["cheap"]
    options = dict(out["options"])
    words = []
    if out["np"] < 2:
        words.append("one rank: nothing is exchanged, hvd_dgc and Horovod run alike")
    elif final["speedup"] < 1.0 and not any("sparse" in g or "through" in g
                                            for g in final["groups"]):
        options = {"density": 1.0}
        words.append("every tensor goes dense on this link: Horovod's dense averaging "
                      "(density=1.0) is as fast")
    else:
        wait = final["exchange_seconds"] / final["exchange_every"]
        busy = out["compute_seconds"] + final["local_seconds"]
        if out["resolved"]["delay"] == 0 and busy > 0 and wait > 0.5 * busy and \
                not (out["optimizer"] != "sgd" and out["resolved"]["adam_declined"]):
            delay = min(8, max(1, math.ceil(wait / busy)))
            options["delay"] = delay
            left = max(0.0, wait - delay * busy)
            period = 1
            if left > 0.5 * busy and out["resolved"]["period"] == 1:
                period = min(8, math.ceil(left / (0.5 * busy)))  # (1.5 compute at most)
                options["period"] = period
            step = busy + left / period
            also = f" and period={period} (an exchange every {period} steps: see " \
                f"docs/slow-networks.md for its accuracy)" if period > 1 else ""
            words.append(f"the exchange ({wait * 1e3:,.0f} ms) outlasts half a step's "
                         f"compute ({busy * 1e3:,.0f} ms): delay={delay}{also} hide it "
                         f"behind {delay} step(s) of compute, a step of "
                         f"{step * 1e3:,.0f} ms, {out['horovod']['step_seconds'] / step:.2f}x "
                         f"Horovod's (flush() before evaluating)")
        words.append(f"predicted {final['speedup']:.2f}x Horovod's step once the warm-up "
                     f"ends")
    command = (f"horovodrun -np {out['np']} -H {host_text} --config-file {config} "
               f"python train.py")
    return {"horovodrun_config": config, "command": command, "options": options,
            "why": words}


def _mb(x):
    return f"{x / 1e6:,.2f} MB" if x >= 1e4 else f"{x / 1e3:,.1f} kB"


def _ms(s):
    return f"{s * 1e3:,.0f} ms" if s >= 0.01 else f"{s * 1e3:.2f} ms"


def report(out, per_tensor=False):
    """The prediction in words, for a terminal."""
    lines = []
    link = out["link"]
    lines.append(f"{out['model']}: {out['parameters'] / 1e6:,.1f}M parameters in "
                 f"{out['tensors']} tensors; {out['np']} ranks on {out['hosts']} host(s); "
                 f"link {link['rate_mbit']:g} Mbit/s, RTT {link['rtt_ms']:g} ms "
                 f"({link['alpha_us']:,.0f} us a message, allgather "
                 f"{link['gather_mbit']:g} Mbit/s); {out['optimizer']}"
                 + (f" with {_opts(out['options'])}" if out["options"] else ""))
    lines.append(f"compute {_ms(out['compute_seconds'])} a step ({out['compute_how']})")
    if out["local_cost_words"]:
        lines.append(out["local_cost_words"])
    r = out["resolved"]
    run = f"hvd_dgc runs {r['compressor']}"
    if r["period"] > 1:
        run += f", an exchange every {r['period']} steps"
    if r["delay"]:
        run += f", delay={r['delay']}"
    if r["adam_declined"]:
        run += " (Adam left exact: nothing would go sparse on this link)"
    h = out["horovod"]
    lines.append(f"{run}. Horovod: {_mb(h['bytes_per_step'])} a step per rank in "
                 f"{h['launches']} allreduce(s), step {_ms(h['step_seconds'])}")
    lines.append("")
    for s in out["stages"]:
        groups = ", ".join(f"{n} {g}" for g, n in s["groups"].items())
        lines.append(f"{s['stage']}, density {s['density']:.4g}: {groups}")
        every = f" (one step in {s['exchange_every']})" if s["exchange_every"] > 1 else ""
        lines.append(f"  sent per step by one rank {_mb(s['bytes_per_step'])}{every}; "
                     f"step {_ms(s['step_seconds'])} against Horovod's "
                     f"{_ms(s['horovod_step_seconds'])}: {s['speedup']:.2f}x")
        if per_tensor:
            for name, path in s["paths"].items():
                lines.append(f"    {name}: {path}")
    rec = out["recommend"]
    lines.append("")
    lines.append("Recommended:")
    for w in rec["why"]:
        lines.append(f"  {w}")
    opts = _opts(rec["options"])
    lines.append(f"  hvd_dgc options: {opts or 'the defaults'}")
    lines.append(f"  {rec['command']}")
    return "\n".join(lines)


def _opts(options):
    return ", ".join(f"{k}={v!r}" for k, v in options.items())


def main(argv=None):
    p = _parser()
    args = p.parse_args(argv)
    with _tf_quiet():  # (a Keras model's TensorFlow)
        out = predict(args, p)
    print(json.dumps(out, indent=1) if args.json else report(out, args.per_tensor))
    return 0


if __name__ == "__main__":
    sys.exit(main())
