"""What a wrapper's options and arguments come to, checked, once for every framework.

``DGCConfig.resolve`` (hvd_dgc/config.py) hands its options here with the wrapper's
arguments: the compressor the script named (or Adam's default sign), the density
schedule (behind Adam's freeze where Adam is taken over), the paths the cost model may
choose among, what of the optimizer's update DGC applies, and every wrap-time check of
Horovod's own arguments and of the wrapped optimizer, each with its message. The
PyTorch optimizer, the TensorFlow tape and the Keras optimizer all resolve here, so the
same mistake reads the same everywhere. The result, ``Resolved``, is configuration only:
what changes while training is state, kept by each framework's parts.
"""

from typing import Any, NamedTuple, Optional

from hvd_dgc.adam import ZERO_ONE_PERIOD, FrozenAdamSchedule, freeze_steps, resolve_refresh
from hvd_dgc.costmodel import CostModel, default_cost_model
from hvd_dgc.paths import AGGREGATION_OPTIONS, compressor_kind
from hvd_dgc.say import rank0_once
from hvd_dgc.schedule import DEFAULT_SENDS, DensitySchedule, as_schedule
from hvd_dgc.switch import TakeOver, dense_requested, resolve_compression, take_over

__all__ = ["resolve", "Framework", "HorovodArguments", "Resolved", "aggregation_choices",
           "check_horovod_arguments", "check_linear_update", "check_clipping_under_lagging",
           "warn_known_losses", "ADAM_LAG_LIMIT"]


def resolve(config, framework, compression, horovod, optimizer=None, *,
            dense_compression=None, grad_scaler=None):
    """What these options and a wrapper's arguments come to, checked: every wrap-time
    check and message of the PyTorch optimizer, the TensorFlow tape and the Keras
    optimizer, in one place (so the same mistake reads the same everywhere).

    ``framework``: a ``Framework``; ``compression``: the wrapper's argument;
    ``horovod``: ``HorovodArguments``; ``optimizer``: ``(is_sgd, class name[, is_adam])``
    of the wrapped optimizer (is_adam: an Adam or AdamW, which it can take over), or None
    (a tape does not know it). ``dense_compression`` and
    ``grad_scaler``: PyTorch's. Returns ``Resolved``."""
    fw = framework.name
    horovod.check(framework)
    lagging, undo = config.lagging, config.undo_lagging
    if lagging and grad_scaler is not None:
        raise ValueError(f"{lagging} with grad_scaler is not supported: an overflow seen "
                         f"steps later cannot be undone. Use {undo} with mixed precision.")
    choice = resolve_compression(compression, framework.compression, framework.ours, fw)
    adam = optimizer is not None and len(optimizer) > 2 and bool(optimizer[2])
    if adam and choice.horovod_name in ("default", "none", "fp16") and \
            not config.asks_topk and config.freeze_variance is not False:
        # Adam/AdamW taken over, no top-k asked for: the sign (1-bit Adam), and with
        # no delay or period chosen 0/1 Adam's period (adam.py ZERO_ONE_PERIOD),
        # dropped again where the take-over is declined (plan.py settled)
        namespace = framework.compression
        zero_one = not config.asks_lagging and grad_scaler is None
        return resolve(
            config.replace(period=ZERO_ONE_PERIOD) if zero_one else config,
            framework, namespace.sign, horovod, optimizer,
            dense_compression=namespace.fp16 if choice.fp16 else dense_compression,
            grad_scaler=grad_scaler)._replace(zero_one=zero_one, chosen=False)
    namespace = framework.compression
    compressor, dense_fp16 = _compressor_values(choice, namespace, dense_compression)
    kind = compressor_kind(compressor)
    aggregations = aggregation_choices(config.aggregation, kind == "sparse",
                                       repr(compressor), framework.sparse_default)
    refresh = resolve_refresh(config.freeze_variance, config.refresh_variance)
    freeze = None
    if kind == "exchange":
        schedule, freeze = _exchange_schedule(config, compressor, framework, adam, refresh)
    elif dense_requested(config.density, config.warmup) and config.aggregation not in (
            "allgather", "region", "hierarchical"):
        compressor, kind, schedule = namespace.none, "dense", as_schedule(1.0)
    else:
        schedule, freeze = _sparse_schedule(config, fw, optimizer, adam, refresh)
    _check_optimizer_options(config, fw, optimizer, adam, freeze)
    if kind != "dense":
        # A copy per optimizer: the sampler's RNG and PowerSGD's Q belong to one
        # optimizer's checkpoint, not to the shared Compression.dgc default.
        compressor = compressor()
    # the link is measured where the script names no cost model (and there is a
    # choice to make: a dense optimizer has none)
    cost_model = CostModel() if kind == "dense" and config.cost_model is None else \
        config.cost_model if config.cost_model is not None else default_cost_model()
    return Resolved(config, fw, compressor, kind, choice.fp16, dense_fp16, schedule,
                    aggregations, freeze,
                    take_over(optimizer, freeze, fw) if kind != "dense" else TakeOver(),
                    cost_model, refresh if freeze is not None else False,
                    batched=framework.batched)


def _exchange_schedule(config, compressor, framework, adam, refresh):
    """``(schedule, freeze)`` of a compressor that runs its own collectives on every
    element (sign, QSGD, PowerSGD, ...): no density; Adam taken over runs exact Adam on
    dense averages to the freeze, then the compressor on the linear update (sign: 1-bit
    Adam itself; plan.py ``path``)."""
    lagging, undo = config.lagging, config.undo_lagging
    if config.density is not None or config.warmup:
        raise ValueError(f"density/warmup apply to sparse compressors, but compression="
                         f"{compressor!r} compresses every element of each "
                         f"large tensor. Use compression={framework.sparse_default} "
                         f"to sparsify.")
    if lagging and not compressor.sent_at_launch:
        raise ValueError(f"{lagging} does not work with compression={compressor!r}: "
                         f"what this rank sent is known only after its first "
                         f"collective, and a later correction needs it at once. Use "
                         f"{undo}, or a one-round compressor (Compression.sign, qsgd, "
                         f"bf16, dgc).")
    schedule = as_schedule(1.0)
    freeze = freeze_steps(config.freeze_variance, refresh) if adam else None
    if freeze is not None:
        schedule = FrozenAdamSchedule(freeze, schedule, refresh)
    return schedule, freeze

def _sparse_schedule(config, fw, optimizer, adam, refresh):
    """``(schedule, freeze)`` of a sparse compressor: the density schedule (adaptive
    optimizers get the longer default warm-up), behind Adam's freeze where Adam is
    taken over."""
    density, warmup = config.density, config.warmup
    adaptive = optimizer is not None and not optimizer[0]
    freeze = freeze_steps(config.freeze_variance, refresh) if adam else None
    if freeze is not None and density is None and warmup is None:
        schedule = FrozenAdamSchedule.default(freeze, refresh) \
            if config.warmup_densities is None else FrozenAdamSchedule(
                freeze, DensitySchedule.coverage(0.001, DEFAULT_SENDS,
                                                 config.warmup_densities), refresh)
    else:
        schedule = as_schedule(density, warmup, config.warmup_unit,
                               config.warmup_densities, adaptive=adaptive)
        if freeze is not None:
            schedule = FrozenAdamSchedule(freeze, schedule, refresh)
    if fw == "tensorflow" and not isinstance(
            getattr(schedule, "inner", schedule), DensitySchedule):
        raise TypeError("hvd_dgc.tensorflow needs density as a number or a "
                        "hvd_dgc.DensitySchedule (evaluated inside the graph), not a "
                        "Python callable")
    return schedule, freeze

def _check_optimizer_options(config, fw, optimizer, adam, freeze):
    """The options that depend on the wrapped optimizer: Adam's freeze and refresh,
    a linear update for delay and period, the settings known to lose."""
    if fw == "tensorflow" and optimizer is None and config.freeze_variance != "auto":
        raise ValueError(f"freeze_variance={config.freeze_variance!r} applies to Adam/AdamW "
                         f"wrapped by hvd_dgc.tensorflow.keras.DistributedOptimizer; "
                         f"DistributedGradientTape does not know the optimizer (an Adam "
                         f"after it runs on error feedback). Pass no freeze_variance.")
    if optimizer is not None and not adam and config.freeze_variance != "auto":
        rank0_once(f"hvd_dgc: freeze_variance={config.freeze_variance!r} applies to Adam "
                   f"and AdamW; {optimizer[1]} has no variance to freeze, so it does "
                   f"nothing here: drop it.", UserWarning, key="hvd_dgc.freeze_unused")
    if config.refresh_variance not in (None, False) and freeze is None:
        raise ValueError(f"refresh_variance={config.refresh_variance!r} refreshes Adam's "
                         f"frozen variance: it needs torch.optim.Adam or AdamW (Keras' "
                         f"Adam or AdamW) with freeze_variance 'auto' or a number of "
                         f"steps, and a sparse compressor. Pass no refresh_variance.")
    if optimizer is not None:
        check_linear_update(config, optimizer[0] or freeze is not None, optimizer[1], fw,
                            adam=adam)
        warn_known_losses(config, optimizer[1], freeze is not None)


class Framework(NamedTuple):
    """What ``DGCConfig.resolve`` needs to know of a framework: its name ("torch" or
    "tensorflow"), its ``Compression`` namespace (Horovod's ``none``/``fp16`` beside
    hvd_dgc's), the base classes of hvd_dgc's compressors there, and its tensor class
    (members of Horovod's ``groups``), and the paths whose one launch carries all of a
    step's tensors on it (PyTorch's region reduce: its latency is paid once a step)."""

    name: str
    compression: object
    ours: tuple
    tensor: type = object
    tensor_name: str = "tf.Variable"
    batched: frozenset = frozenset()

    @property
    def sparse_default(self):
        return f"hvd_dgc.{self.name}.Compression.dgc"


class HorovodArguments(NamedTuple):
    """Horovod's own arguments to a wrapper, checked as Horovod checks them, plus what
    DGC cannot do with them. ``ops``: the framework's (Average, Sum, Adasum)."""

    op: object
    gradient_predivide_factor: float
    backward_passes_per_step: int
    groups: object
    ops: tuple

    def check(self, framework):
        check_horovod_arguments(self.op, self.gradient_predivide_factor,
                                self.backward_passes_per_step, self.groups, self.ops,
                                framework.tensor_name)
        if isinstance(self.groups, list) and framework.tensor is not object:
            seen = set()
            for group in self.groups:
                for p in group:
                    if not isinstance(p, framework.tensor):
                        raise ValueError(f"groups must consist of {framework.tensor_name}.")
                    if id(p) in seen:
                        raise ValueError("A parameter can only appear once in groups.")
                    seen.add(id(p))


class Resolved(NamedTuple):
    """A wrapper's options and arguments, resolved and checked (``DGCConfig.resolve``):
    what the planner and each framework's parts are built from. Configuration only: what
    changes while training is state, kept elsewhere."""

    config: Any            # the DGCConfig
    framework: str
    compressor: object     # this optimizer's own (a copy); Compression.none when dense
    kind: str              # "sparse", "exchange" or "dense" (paths.compressor_kind)
    fp16_values: bool      # Horovod's Compression.fp16: fp16 in the records
    dense_fp16: bool       # fp16 on the dense path
    schedule: object       # DensitySchedule, or (PyTorch) a callable f(step, epoch)
    aggregations: tuple    # the PathKinds the cost model may choose among
    freeze: Optional[int] = None  # Adam taken over: its second moment frozen here (adam.py)
    taken_over: TakeOver = TakeOver()  # what of the optimizer's update DGC applies, in words
    cost_model: Any = None  # a CostModel, or "measure" (the default: costmodel.py)
    refresh: Any = False   # the frozen variance refreshed: False, "auto" or k (adam.py)
    zero_one: bool = False  # 0/1 Adam by default (adam.py ZERO_ONE_PERIOD): its period is
    #                         Adam's default, not the script's, dropped where Adam is not
    #                         taken over
    chosen: bool = True  # the compressor is the script's (False: Adam's default sign, which
    #                      the messages leave unnamed where it changes nothing)
    batched: frozenset = frozenset()  # Framework.batched

    def every_step(self):
        """These options with 0/1 Adam's default period dropped: its exchange at every
        step (plan.py ``settled`` where Adam is declined; TensorFlow's IndexedSlices)."""
        return self._replace(config=self.config.replace(period=1))

    @property
    def chosen_lagging(self):
        """The delay and period the script chose, in words ("" when none): 0/1 Adam's
        default period is not among them (plan.py ``adam_freeze`` may decline it)."""
        return "" if self.zero_one else self.config.lagging

    @property
    def sparse(self):
        return self.kind == "sparse"

    @property
    def exchange(self):
        return self.kind == "exchange"

    def final_density(self):
        """The density after the warm-up (None: a callable schedule)."""
        if not self.sparse:
            return 1.0
        return getattr(self.schedule, "density", None)


def _compressor_values(choice, namespace, dense_compression):
    """``(compressor, dense_fp16)``: the compressor ``choice`` names, with fp16 records
    where Horovod's ``Compression.fp16`` asked for them, and whether the dense path's
    values travel in fp16 (that, or ``dense_compression=Compression.fp16``)."""
    compressor = choice.compressor
    if choice.fp16:  # Horovod's Compression.fp16: fp16 records (and dense path)
        compressor = compressor(fp16_values=True)
    if dense_compression is not None and dense_compression not in (namespace.none,
                                                                   namespace.fp16):
        raise ValueError(f"dense_compression must be Compression.none or Compression.fp16, "
                         f"got {dense_compression!r}")
    return compressor, choice.fp16 or dense_compression is namespace.fp16


def describe(compression):
    """A compressor as the consistency check and the messages name it."""
    if hasattr(compression, "config"):
        return repr(compression.config())
    return getattr(compression, "__name__", type(compression).__name__)


def aggregation_choices(aggregation, sparse, compression, sparse_default):
    """The validated ``aggregation=`` option, as the cost model's allowed paths.
    ``sparse``: the compressor sends records; ``compression`` and ``sparse_default``
    name the user's compressor and the fix in the error."""
    if not isinstance(aggregation, str) or aggregation not in AGGREGATION_OPTIONS:
        raise ValueError(f"aggregation must be one of {sorted(AGGREGATION_OPTIONS)}, got "
                         f"{aggregation!r}")
    if aggregation in ("allgather", "region", "hierarchical") and not sparse:
        raise ValueError(f"aggregation={aggregation!r} sums sparse records, but compression="
                         f"{compression} is not a sparse compressor. Use compression="
                         f"{sparse_default}, or aggregation='auto'.")
    return AGGREGATION_OPTIONS[aggregation]


def check_linear_update(config, linear, optimizer_name, framework, adam=False):
    """Delayed averaging and period > 1 replace this rank's own steps by the average
    later: exact only for an update linear in the gradient (SGD, or Adam once its
    variance is frozen: adam.py). ``linear``: the wrapped optimizer's update is."""
    if config.lagging and not linear:
        kind = "torch.optim.SGD" if framework == "torch" else "a Keras SGD optimizer"
        kind += " or Adam/AdamW with its variance frozen (freeze_variance)"
        fix = f"Use {config.undo_lagging}"
        if adam:
            fix += (", or a compressor (DGC, the default, or sign: 1-bit Adam) with "
                    "freeze_variance='auto' (the default)"
                    if config.freeze_variance is not False else
                    ", or freeze_variance='auto' (the default)")
        raise ValueError(f"{config.lagging} needs {kind}: the correction g_i - g_(i-D) + "
                         f"avg_(i-D) (own steps replaced by the average) is exact only for "
                         f"an update linear in the gradient, and {optimizer_name} is not. "
                         f"{fix}.")


def check_clipping_under_lagging(config, optimizer_name, clipping):
    """An optimizer that clips what it is given (Keras' ``clipnorm``, ``clipvalue``,
    ``global_clipnorm``: ``clipping`` maps each one set to its value) clips, under delay
    or period, ``own_i - own_(i-D) + avg_(i-D)`` by each rank's own norm: the correction
    no longer cancels and the ranks drift apart. Refused with the fix. (PyTorch, where the
    script clips between ``synchronize()`` and ``step()``, warns: torch/optimizer.py.)"""
    if clipping and config.lagging:
        option, value = next(iter(clipping.items()))
        raise ValueError(
            f"hvd_dgc: {optimizer_name}({option}={value!r}) with {config.lagging}: each "
            f"rank would clip its delayed correction by its own norm and the ranks would "
            f"drift apart. Use hvd_dgc's clip_norm= (before the memory) instead, or "
            f"{config.undo_lagging}.")


#: steps an average may lag (delay, or AutoDelay's max_delay, plus period) from which an
#: Adam/AdamW taken over diverged (bench/results/zoo.md: a GPT-style LM, AdamW with betas
#: (0.9, 0.95), at period=8, delay=8 in every seed; period=4, delay=4 held)
ADAM_LAG_LIMIT = 16


def warn_known_losses(config, optimizer_name, adam_taken_over):
    """Once, on rank 0: a setting the model zoo (bench/zoo.py) saw lose on a recipe of
    the kind wrapped, with what held instead."""
    delay = config.auto_delay.max_delay if config.auto_delay is not None else config.delay
    if adam_taken_over and delay + config.period >= ADAM_LAG_LIMIT:
        rank0_once(f"hvd_dgc: {optimizer_name} with {config.lagging}: averages up to "
                   f"{delay + config.period} steps late diverged on a GPT-style AdamW "
                   f"(bench/results/zoo.md). Keep delay + period under {ADAM_LAG_LIMIT} "
                   f"(period=4, delay=4 held) or use outer=hvd.OuterLoop(...).",
                   UserWarning, key="hvd_dgc.adam_lag")


def check_horovod_arguments(op, gradient_predivide_factor, backward_passes_per_step, groups,
                            ops, tensor_kind):
    """Horovod's own arguments, checked as Horovod checks them, plus what DGC cannot do.
    ``ops``: the framework's (Average, Sum, Adasum); ``tensor_kind`` names group members."""
    average, summed, adasum = ops
    if gradient_predivide_factor != 1.0 and op != average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if isinstance(backward_passes_per_step, bool) or not isinstance(
            backward_passes_per_step, int) or backward_passes_per_step <= 0:
        raise ValueError(f"backward_passes_per_step must be an int > 0, got "
                         f"{backward_passes_per_step!r}")
    if op == adasum:
        raise ValueError("hvd_dgc: op=Adasum is not supported (Adasum combines dense "
                         "gradients pairwise; DGC sends sparse ones). Use op=Average.")
    if op not in (average, summed):
        raise ValueError(f"hvd_dgc: op must be hvd.Average or hvd.Sum, got {op!r}")
    if groups is not None and not (isinstance(groups, list) or (
            isinstance(groups, int) and not isinstance(groups, bool) and groups > 0)):
        raise ValueError(f"groups should be a non-negative integer or a list of list of "
                         f"{tensor_kind}.")
