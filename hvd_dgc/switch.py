"""What the one-line switch makes of a Horovod script's ``compression=`` argument.

Horovod's own examples, and the scripts written from them, pass
``compression=hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none``
explicitly. With ``import hvd_dgc.torch as hvd`` (or the TensorFlow/Keras
equivalent) in place of Horovod's import, those two keep Horovod's meaning of
how values travel, while hvd_dgc's optimizer sparsifies:

    Compression.none  -> DGC, float32 values (records and the dense small tensors)
    Compression.fp16  -> DGC, float16 values in the records and on the dense path
    a name ("dgc", "topk", ..., "none", "fp16"; config files, command lines)
                      -> the compressor of that name, as above
    a compressor class where an instance is needed (``DGCCompressor``)
                      -> its default instance
    density=1.0       -> dense averaging, said explicitly (no sparsification)
    not given         -> DGC, as Compression.none

With Adam or AdamW (taken over: hvd_dgc/adam.py) and no option of DGC's top-k, none,
fp16 and not given mean 0/1 Adam instead: the scaled sign from the freeze, every 4th
step (config.py ``DGCConfig.resolve``, adam.py ``ZERO_ONE_PERIOD``).

Anything else is refused with an error that names it and the fix: nothing
silently trains dense. Shared by the PyTorch and TensorFlow sides; each passes
its own ``Compression`` namespace and the base classes of its compressors.
"""

from typing import NamedTuple

from hvd_dgc.paths import SUMS

__all__ = ["Choice", "resolve_compression", "dense_requested", "idle_warning",
           "gather_idle_warning", "summary", "brief", "change_line", "percent",
           "long_trace_line", "LINE_LIMIT", "CHANGE_LIMIT", "HINT", "LONG_TRACE"]

#: The most characters of the wrap-time line rank 0 prints by default (``brief``), and of
#: the line it prints when the plan changes while training (``change_line``).
LINE_LIMIT = 200
CHANGE_LIMIT = 120
#: How to see the full plan, as the default line ends.
HINT = "verbose=True for the plan"
_LABELS = {"dgc": "DGC", "topk": "top-k", "randomk": "random-k"}
#: Compressed paths (a tensor at a density stage) from which a traced TensorFlow step
#: says its first run will be long: each costs about a second on a CPU core to trace and
#: to prepare (10 tensors compressed at 5 stages: 24 s of tracing, 25 s to the first run).
LONG_TRACE = 100

class Choice(NamedTuple):
    """A resolved ``compression=``: the compressor, whether values travel as fp16
    (Horovod's ``Compression.fp16``: each framework applies it to its records and
    dense path), and the Horovod name it came from, if any."""

    compressor: object
    fp16: bool
    horovod_name: object


def resolve_compression(compression, namespace, ours, framework):
    """``Choice`` for a ``compression=`` argument (see the module docstring).

    ``namespace``: the framework's ``Compression`` (attributes ``dgc``, ``none``,
    ``fp16``, ...); ``ours``: base classes of hvd_dgc's compressors there;
    ``framework``: "torch" or "tensorflow", for the messages."""
    names = sorted(n for n in vars(namespace) if not n.startswith("_"))
    if compression is None:  # not given: the optimizer's default (config.py resolve)
        return Choice(namespace.dgc, False, "default")
    if isinstance(compression, str):
        name = compression.strip().lower()
        if name not in names:
            raise ValueError(
                f"compression={compression!r} is not a compressor name; use one of "
                f"{', '.join(repr(n) for n in names)} (or hvd_dgc.{framework}.Compression.<name>)")
        compression = getattr(namespace, name)
    none, fp16 = namespace.none, namespace.fp16
    if compression is none or isinstance(compression, none):
        return Choice(namespace.dgc, False, "none")
    if compression is fp16 or isinstance(compression, fp16):
        return Choice(namespace.dgc, True, "fp16")
    if isinstance(compression, type):
        if issubclass(compression, ours):
            return Choice(compression(), False, None)
        raise TypeError(
            f"compression={compression.__name__} is a class hvd_dgc cannot use: pass one of "
            f"hvd_dgc.{framework}.Compression's compressors ({', '.join(names)}), or its name "
            f"as a string")
    if isinstance(compression, ours):
        return Choice(compression, False, None)
    raise TypeError(
        f"compression={compression!r} ({type(compression).__name__}) is not one of "
        f"hvd_dgc's compressors: hvd_dgc's optimizer selects and packs the values itself, "
        f"so it cannot run a compressor written for Horovod's dense allreduce. Pass one of "
        f"hvd_dgc.{framework}.Compression's ({', '.join(names)}), or its name; "
        f"Horovod's Compression.none / fp16 mean DGC with fp32 / fp16 values, and "
        f"density=1.0 trains dense.")


def _sums(methods):
    """How the sparse tensors are summed, in words."""
    named = [words for path, words in SUMS.items() if path in methods]
    return " / ".join(named) if named else "allgather"


def dense_requested(density, warmup):
    """``density=1.0`` (a number, no warm-up): the user asks for dense averaging."""
    return (isinstance(density, (int, float)) and not isinstance(density, bool)
            and float(density) == 1.0 and not warmup)


def idle_warning(kind, min_compress_size, large, sparse_at_final, density, world,
                 measured=False):
    """Why DGC would do nothing with this set-up, or None: no tensor of
    ``min_compress_size`` elements (``large`` is False), or a final density at which the
    cost model sends every large tensor dense (``sparse_at_final`` is False; ``measured``:
    on the link the probe timed, which is then the right choice)."""
    if not large:
        return (f"hvd_dgc: no trainable tensor has min_compress_size={min_compress_size} "
                f"elements or more, so every tensor goes dense and {kind} does nothing; "
                f"lower min_compress_size, or pass density=1.0 to say dense.")
    if not sparse_at_final and measured:
        return (f"hvd_dgc: on the link measured between the {world} ranks, a dense allreduce "
                f"of each tensor costs less than selecting and sending density {density:g} "
                f"of it, so DGC sends every tensor dense (as Horovod does); to compress "
                f"anyway, pass cost_model=hvd_dgc.CostModel(alpha=..., bandwidth=...) for "
                f"the link you expect.")
    if not sparse_at_final:
        return (f"hvd_dgc: at density {density:g} and {world} ranks the cost model sends "
                f"every tensor dense (a sparse allgather would cost more), so DGC does "
                f"nothing; lower the density, or pass density=1.0 to say dense.")
    return None


def adam_idle_warning(share, threshold, measured=False):
    """Why an Adam-family optimizer is left exact with every tensor dense: the tensors
    that would go sparse hold only ``share`` of the gradient, under ``threshold``
    (adam.py ``ADAM_SPARSE_SHARE``): too little to pay for a frozen variance."""
    link = "the link measured between the ranks" if measured else "this link"
    return (f"hvd_dgc: on {link} only {share:.1%} of the gradient would go sparse (under "
            f"{threshold:.0%}), too little to be worth freezing Adam's variance, so every "
            f"tensor goes dense and Adam runs exact (as with Horovod); to compress anyway, "
            f"pass cost_model=hvd_dgc.CostModel(alpha=..., bandwidth=...) for the link you "
            f"expect, or delay/period (which take Adam over from its freeze).")


def gather_idle_warning(kind, world, measured=False, collective="allgather"):
    """Why a payload compressor (sign, QSGD, bf16) does nothing: its ``collective``
    (its allgather, or the sign's compressed allreduce), with its encoding and decoding
    where they were ``measured``, costs more than the dense allreduce of every large
    tensor."""
    if measured or collective != "allgather":
        return (f"hvd_dgc: on the link {'measured' if measured else 'assumed'} between the "
                f"{world} ranks, {kind}'s {collective} with its encoding and decoding costs "
                f"more than a dense allreduce "
                f"of each tensor, so every tensor goes dense (as Horovod does) and {kind} "
                f"does nothing; to compress anyway, pass cost_model=hvd_dgc.CostModel("
                f"alpha=..., bandwidth=...) for the link you expect.")
    return (f"hvd_dgc: at {world} ranks every rank would receive {world - 1} {kind} "
            f"payloads of each tensor, more than the dense allreduce moves, so every tensor "
            f"goes dense (as Horovod does) and {kind} does nothing; DGC (the default) or "
            f"PowerSGD send volumes that do not grow with the ranks.")


class TakeOver(NamedTuple):
    """What of the wrapped optimizer's update DGC's memory applies, in words: ``said`` for
    the rank-0 line, ``lost`` (a warning) where nothing is taken over."""

    said: str = ""
    lost: object = None
    name: str = ""  # the wrapped optimizer's class name ("" for a tape)


def take_over(optimizer, freeze, framework):
    """``optimizer``: ``(is_sgd, class name[, is_adam])`` as ``DGCConfig.resolve`` gets it,
    or None (a tape: no optimizer known); ``freeze``: Adam's variance frozen at that
    step (hvd_dgc/adam.py), or None."""
    if optimizer is None:
        return TakeOver()
    is_sgd, name = optimizer[0], optimizer[1]
    if is_sgd:
        return TakeOver("SGD's momentum in DGC's memory (momentum correction)", name=name)
    if freeze is not None:  # (the density schedule's words say it: FrozenAdamSchedule)
        return TakeOver(name=name)
    taken = ("torch.optim.SGD, Adam and AdamW (Adam's with freeze_variance='auto', the "
             "default)" if framework == "torch" else "Keras' SGD, Adam and AdamW (Adam's "
             "with freeze_variance='auto', the default)")
    return TakeOver(f"{name} not taken over: error feedback on its raw gradient",
                    f"hvd_dgc: {name} is not taken over: DGC sends its raw gradient through "
                    f"error feedback, so there is no momentum correction, its adaptive step "
                    f"sees each coordinate in bursts (the warm-up is longer for it), and "
                    f"delay and period are refused. hvd_dgc takes over {taken}; to average "
                    f"densely instead, pass density=1.0.", name)


def summary(kind, density, warmup, min_compress_size, dense_fp16, record_bits, delay,
            compressed, total, framework, sums=("sparse",), period=1, taken_over="",
            measured="", zero_one=False):
    """The one line rank 0 prints at wrap time: what hvd_dgc does and how to turn it off.

    ``kind``: "dgc", "topk", ... or "dense"; ``density``: the final density; ``warmup``:
    the warm-up in words (DensitySchedule.describe) or ""; ``compressed``/``total``: how
    many trainable tensors are large enough to be sparsified, of how many; ``sums``: the
    paths for them at the final density (hvd_dgc.paths.PathKind); ``zero_one``: the
    period is 0/1 Adam's default (adam.py ``ZERO_ONE_PERIOD``), not the script's;
    ``record_bits``: a record's value on the allgather (packing.gather_value_bits)."""
    values = {8: "fp8", 16: "fp16"}.get(record_bits, "fp32")
    dense_values = "fp16" if dense_fp16 else "fp32"
    if kind == "dense":
        return (f"[hvd_dgc] {framework}: dense averaging (density=1.0), {dense_values} "
                f"values: nothing is sparsified.")
    if kind in ("dgc", "topk", "randomk"):
        what = (f"{'DGC' if kind == 'dgc' else kind} at density {density:g}"
                f"{', ' + warmup if warmup else ', no warm-up'}: {compressed} of "
                f"{total} tensors sparse ({values} records, {_sums(sums)}), the rest dense "
                f"(< {min_compress_size} elements{', or dense costs less' if measured else ''}"
                f", {dense_values} allreduce)")
    else:
        what = (f"compressor {kind} on {compressed} of {total} tensors, the rest dense "
                f"({dense_values} allreduce)")
    if taken_over:
        what += f"; {taken_over}"
    if delay:
        what += f"; delayed averaging, delay={delay}"
    if period > 1:
        what += f"; an exchange every {period} steps (period={period})"
        if zero_one:
            what += (", each rank stepping on its own between: 0/1 Adam (Lu et al.), Adam's "
                     "default where no option is given (period=1 exchanges every step, "
                     "compression='dgc' sends DGC's top-k)")
    if measured:  # cost_model="measure": the link, DGC's own work, what runs dense
        what += f"; {measured}"
    return f"[hvd_dgc] {framework}: {what}. For dense averaging: density=1.0."


def long_trace_line(tensors, paths, stages):
    """The line rank 0 prints once where a TensorFlow step's graph holds ``paths``
    compressed paths (``tensors`` tensors over ``stages`` density stages: every stage's
    are traced into the one graph), or None below ``LONG_TRACE``."""
    if paths < LONG_TRACE:
        return None
    return (f"[hvd_dgc] tensorflow: the step's graph holds {tensors} compressed tensors "
            f"at each of {stages} density stages ({paths} paths): its first run may take "
            f"minutes to trace and prepare, once.")


def percent(density):
    """A density as a user reads it: 0.25 -> "25%", 0.001 -> "0.1%", 0.015625 ->
    "1.56%"."""
    return f"{density * 100:.3g}%"


def _ordinal(n):
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def brief(framework, kind, final=1.0, *, start=None, until=None, unit="step", sparse=0,
          sparse_start=None, total=0, name="", freeze=None, declined=False, zero_one=False,
          chosen=True, delay=0, period=1, schedule_callable=False, large=None,
          min_compress_size=0):
    """The one line rank 0 prints at wrap time by default (at most ``LINE_LIMIT``
    characters, for both frameworks): what runs now, what comes later, and how to see the
    full plan (``summary``, with ``verbose=True``).

    ``kind``: "dense", "dgc", "topk", "randomk" (sparse) or a compressor of its own
    collectives ("sign", "qsgd", "powersgd", ...); ``final``: the density after the
    warm-up; ``start``: the compressor's first density (the warm-up's first stage, or
    ``final``) and ``until`` where the final one begins, in ``unit``s (None: no
    warm-up); ``sparse`` / ``sparse_start``: how many of the ``total`` tensors leave
    compressed at ``final`` / ``start``; ``name``: the wrapped optimizer's class;
    ``freeze``: Adam taken over, exact to this step; ``declined``: Adam left exact
    (compressing would not pay on this link); ``zero_one``: 0/1 Adam's default period;
    ``chosen``: the compressor is the script's (False: Adam's default sign, named as
    0/1 Adam or 1-bit Adam); ``delay``, ``period``: the script's delayed averaging;
    ``large``: how many tensors have ``min_compress_size`` elements or more."""
    head = f"[hvd_dgc] {framework}: "
    if kind == "dense":
        return head + "dense averaging (density=1.0), as Horovod's."
    if declined:
        who = name or "Adam"
        return (head + f"{who} runs exact, every tensor dense as with Horovod: compressing "
                f"would not pay on this link. {HINT}.")
    adam = f"{name}: " if name and freeze is not None else ""
    exact = f"exact Adam to step {freeze}, then " if freeze is not None else ""
    count = f"{sparse} of {total} tensors compressed, the rest dense"
    if kind in _LABELS:
        what, count = _sparse_what(_LABELS[kind], final, final if start is None else start,
                                   until, unit, sparse, sparse_start, total, freeze,
                                   schedule_callable, large, min_compress_size)
        what = exact + what
    elif not chosen:  # Adam's default: the sign after the freeze (adam.py)
        every = f" every {_ordinal(period)} step, local steps between" if zero_one and \
            period > 1 else ""
        what = (f"{'0/1' if zero_one else '1-bit'} Adam (exact Adam to step {freeze}, then "
                f"1-bit signs{every})")
        if sparse == 0:
            count = ""
    else:
        what = exact + (f"{kind} on {sparse} of {total} tensors, the rest dense" if sparse
                        else f"{kind}: every tensor dense on this link (its collectives "
                             f"would cost more)")
        count = ""
    extra = _lagging_words(delay, period, zero_one)
    parts = [adam + what] + [count] * bool(count) + extra
    line = head + "; ".join(parts) + f". {HINT}."
    if len(line) > LINE_LIMIT and count:  # the count is the first to go
        line = head + "; ".join([adam + what] + extra) + f". {HINT}."
    if len(line) > LINE_LIMIT:
        line = line[:LINE_LIMIT - len(HINT) - 6].rstrip(" ,;") + f"... {HINT}."
    return line


def _sparse_what(label, final, start, until, unit, sparse, sparse_start, total, freeze,
                 schedule_callable, large, min_compress_size):
    """``brief``'s words for a sparse compressor: ``(what runs, the tensors' count)``."""
    count = f"{sparse} of {total} tensors compressed, the rest dense"
    if large == 0:
        return (f"{label}: no tensor has min_compress_size={min_compress_size} elements "
                f"or more: every tensor dense"), ""
    if schedule_callable:
        return f"{label} at {percent(start)} now, as your density schedule says", count
    if sparse == 0:
        return f"{label}: every tensor dense on this link (sparse would cost more)", ""
    if until is not None and start > final:
        now = " now" if freeze is None else ""
        at = f": {percent(start)} of each large tensor{now}" if sparse_start != 0 else \
            f" at {percent(start)}: every tensor dense{now} (cheaper on this link)"
        return (f"{label} warm-up{at}, falling to {percent(final)} by {unit} {until:g}",
                f"{sparse} of {total} tensors compressed at {percent(final)}, the rest dense")
    return f"{label} at {percent(final)} of each large tensor", count


def _lagging_words(delay, period, zero_one):
    """``brief``'s words for the script's delayed averaging and period."""
    extra = []
    if delay:
        delay = "'auto'" if str(delay).startswith("auto") else delay
        extra.append(f"delayed averaging (delay={delay})")
    if period > 1 and not zero_one:
        extra.append(f"an exchange every {period} steps (period={period})")
    return extra


def change_line(step, what, limit=CHANGE_LIMIT):
    """Rank 0's line where the plan changes while training (a re-measured link, a trial
    of the step's own time, a warm-up stage), at most ``limit`` characters."""
    line = f"[hvd_dgc] step {step}: {what}"
    return line if len(line) <= limit else line[:limit - 3].rstrip(" ,;:") + "..."


def outer_line(framework, outer, density, name, full=False):
    """Rank 0's wrap-time line for ``outer=OuterLoop(...)`` (both frameworks): short by
    default (at most ``LINE_LIMIT`` characters), the whole story with ``full``
    (verbose). ``outer``: its ``OuterLoop``; ``density``: of the change each round
    sends; ``name``: the inner optimizer's class."""
    if full:
        values = "whole (allreduce)" if density >= 1 else (
            f"as error-feedback records at density {density:g} of each tensor")
        return (f"[hvd_dgc] {framework}: {outer.words()}; the change sent {values}; "
                f"{name} steps locally between rounds.")
    kind = "Nesterov" if outer.nesterov else ("momentum" if outer.momentum else "SGD")
    sent = "averaged" if density >= 1 else f"averaged as {percent(density)} records"
    line = (f"[hvd_dgc] {framework}: outer loop (DiLoCo): {name} steps alone; every "
            f"{outer.steps} steps the weights' change is {sent}, applied by outer {kind} "
            f"(lr {outer.lr:g}). {HINT}.")
    return line if len(line) <= LINE_LIMIT else line[:LINE_LIMIT - 3] + "..."
