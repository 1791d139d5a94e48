"""hvd_dgc's options, once for every framework: defaults, validation, messages.

The PyTorch ``DistributedOptimizer``, TensorFlow's ``DistributedGradientTape`` and
the Keras ``DistributedOptimizer`` take Horovod's arguments by name, and hvd_dgc's
own as keyword options, which all three hand to ``DGCConfig.from_options``: one
list of options, one check of each, one message per mistake naming the argument
and the fix, whichever framework the script uses. The config is frozen (captured
once at wrap time, as optax captures hyper-parameters); what changes while
training (step, epoch, memory, the delay chosen by ``delay="auto"``) is state,
kept by each framework's optimizer.

``to_dict()`` is what every rank compares at wrap time (hvd_dgc/consistency.py):
ranks that disagree would join different collectives and hang.
"""

import difflib
from dataclasses import dataclass, fields, replace
from typing import Any, Optional

from hvd_dgc.adam import check_freeze_variance, check_refresh_variance
from hvd_dgc.autodelay import AutoDelay, as_auto_delay
from hvd_dgc.costmodel import CostModel
from hvd_dgc.linkwatch import LinkWatch, as_link_watch
from hvd_dgc.masking import check_masking
from hvd_dgc.paths import AGGREGATION_OPTIONS
from hvd_dgc.resolve import resolve
from hvd_dgc.schedule import as_schedule

__all__ = ["DGCConfig", "CompressorOptions", "unsupported_message", "TOPK_OPTIONS",
           "LAGGING_OPTIONS"]


@dataclass(frozen=True)
class DGCConfig:
    """hvd_dgc's options (Lin et al., "Deep Gradient Compression", ICLR 2018; Zhu et
    al., "Delayed Gradient Averaging", NeurIPS 2021).

    Attributes:
        density: fraction of each large tensor sent per step (the paper: 0.001), a
            ``hvd_dgc.DensitySchedule``, or (PyTorch) a callable ``f(step, epoch)``.
            None (the default, with no ``warmup``): the paper's densities 25%, 6.25%,
            1.5625%, 0.4%, then 0.1%, by optimizer steps, each stage as long as every
            coordinate could have travelled 10 times (0.1% from step 10,000; with an
            optimizer other than SGD, whose steps error feedback shrinks, 40 times:
            0.1% from step 40,000; hvd_dgc/schedule.py). 1.0 without a warm-up: dense
            averaging, said explicitly.
        warmup: warm-up length in ``warmup_unit``s; the densities fall through
            ``warmup_densities``, one equal stage each, then ``density``. 0: none.
        warmup_unit: "epoch" (driven by ``set_epoch(e)``, or in Keras' ``model.fit`` by
            any of hvd_dgc's callbacks; the paper's choice; never set by step 200, rank 0
            says so) or "step" (the optimizer's step count).
        warmup_densities: the warm-up stages' densities (default the paper's 0.25,
            0.0625, 0.015625, 0.004); values below ``density`` are raised to it.
        min_compress_size: tensors with fewer elements always go dense (biases, norm
            layers: the paper sends them dense).
        momentum_masking: zero the momentum of the coordinates just sent: True (always,
            as the paper), False (never), or "auto" (default: only at densities where
            the momentum tail it drops is small, ``density <= 0.1 (1 - m) / m``, 1.1% at
            momentum 0.9: the final densities, not the warm-up's first stages;
            hvd_dgc/masking.py).
        clip_norm: local per-tensor gradient clipping at ``clip_norm / sqrt(N)`` before
            the memory (DGC Sec. 3.3); None: off.
        cost_model: ``hvd_dgc.CostModel(alpha, bandwidth, local_alpha,
            local_bandwidth, gather_bandwidth=None)`` choosing each tensor's path (dense
            allreduce, sparse allgather, region reduce, hierarchical) per density stage;
            ``CostModel()``: 1 Gbit/s and 50 us per message between hosts, 10 GB/s and
            5 us inside a host. "measure" (what None means, unless the environment sets
            ``HVD_DGC_COST_MODEL=assumed``: ``CostModel()``, the same paths every run):
            the link between ranks timed at wrap time with Horovod's own allreduce, and
            its allgather where the budget allows (the records' rate; well under a
            second; every rank uses the same numbers, said in rank 0's line;
            hvd_dgc/linkprobe.py), on several hosts of several ranks the link inside a
            host too (hierarchical DGC's in-host alltoall: ``local_alpha``,
            ``local_bandwidth``), and DGC's own work on this device
            (hvd_dgc/localcost.py), so tensors and stages where sparse costs more than
            dense run dense. Under elastic Horovod both measure at each sync of the
            elastic state (``TorchState``, ``KerasState``; after a reset too: every rank
            is there).
        link_watch: with the link measured (``cost_model`` "measure"), delay 0 and
            period 1: the link measured again when the step's own waits for its
            averages say it got slower or faster (an agreed window's mean wait beyond
            twice, or under half, what it was), and the paths chosen afresh where the
            new numbers move the step's predicted exchange by more than 1.5x, said in
            rank 0's log (hvd_dgc/linkwatch.py). None (default): on; False: the
            wrap-time measurement stands; ``hvd_dgc.LinkWatch(window=50, ...)`` to
            change its settings. Keras: ``model.fit`` with hvd_dgc's
            ``BroadcastGlobalVariablesCallback`` (which a Horovod script already passes)
            or ``DGCCallback``: either times whole train steps and has ``fit`` trace the
            step again where the paths changed; ``DistributedGradientTape``: measured at
            wrap time only (its step is traced into the script's own function).
        timeline: PyTorch, with the link measured, delay 0 and period 1: each gradient's
            hook timed over steps 2-4 (agreed across ranks), each step laid out on a
            timeline where the part of a transfer the backward pass hides costs nothing,
            and where that plan differs from the cost model's sums' both run 5 steps and
            the faster is kept, said in rank 0's log (hvd_dgc/overlap.py). Keras'
            ``model.fit`` (with hvd_dgc's ``BroadcastGlobalVariablesCallback`` or
            ``DGCCallback``; a traced step has no hook per gradient): where the sums'
            plan sends some tensor sparse at a density, it and every tensor dense both
            run 5 steps, and sparse is kept only where it made the step 3% faster
            (hvd_dgc/tensorflow/plan_trial.py). None (default): on; False: the sums'
            plan throughout. ``DistributedGradientTape`` keeps the sums' plan.
        delay: delayed gradient averaging (DGA): step i applies ``own_i - own_(i-D) +
            avg_(i-D)``, so D steps of compute hide each exchange; 0 is synchronous.
            "auto" chooses D from measured compute and waits, the same on every
            rank (at most 8; ``hvd_dgc.AutoDelay(max_delay=..., window=20)`` to change
            that). Needs an update linear in the gradient: SGD, or Adam/AdamW taken over
            (``freeze_variance``; delayed from the freeze on); call ``flush()`` before
            evaluating or checkpointing; not with PowerSGD or TernGrad (what they sent is
            known only after a first round), with a GradScaler, or with sparse gradients
            (``sparse_as_dense=True``).
        period: exchange every ``period``-th step only (PyTorch, TensorFlow and Keras);
            in between each rank steps with its own velocity and the exchange's average
            then replaces those steps (hvd_dgc/lagging.py). Needs SGD or Adam taken
            over, and ``flush()``, as ``delay`` does; no GradScaler; with it
            hierarchical DGC falls back to flat methods. Adam and AdamW with neither
            ``delay`` nor ``period`` nor an option of DGC's top-k run 0/1 Adam,
            ``period=4`` (``freeze_variance``); ``period=1`` there exchanges the sign
            every step (1-bit Adam).
        skip_nonfinite: a NaN/Inf gradient on any rank never enters the memory:
            synchronous steps are skipped on every rank (weights, memory, step count
            unchanged; that rank sends inf, so every rank sees it), delayed ones send
            zeros from that rank. Costs the memory's update written beside the old one
            (no copy) and, where the kernel is not built, a pass over the gradients.
        aggregation: how sparse tensors are summed: "auto" (the cost model's choice
            among all), "allgather" (every rank's records to every rank: k(N-1) per
            worker), "region" (region reduce, after Ok-Topk: about 3k(N-1)/N, flat in
            N), "hierarchical" (several hosts of several ranks: summed densely inside
            each host, about k/L records per rank across hosts; not with period;
            TensorFlow: not with Adam taken over yet), "flat" (the cost
            model's choice without hierarchical) or "dense". A forced method runs even
            at density 1 (the equivalence with dense averaging).
        fusion_threshold: bytes on the wire of one launch: tensors ready one after
            another in backward leave together up to this size, so a step takes as few
            of Horovod's negotiation rounds as it can (each costs round trips on a slow
            link); in TensorFlow a bucket is one grouped collective in the step's graph.
            None: Horovod's ``HOROVOD_FUSION_THRESHOLD`` (``horovodrun
            --fusion-threshold-mb``), 64 MiB if unset; 0: each tensor leaves alone
            (from its own hook in PyTorch).
        log_every: print compression statistics on rank 0 every N steps; 0:
            never.
        verbose: False (default): rank 0 says in one short line what runs now and what
            comes later, and in one short line when the plan changes while training;
            True: the full plan (the link measured, each density stage's paths, why a
            tensor goes dense) and each change's full reasons. The environment
            variable ``HVD_DGC_VERBOSE=1`` does the same for every optimizer of the
            job. Like ``log_every``, a rank may set it alone (rank 0 prints).
        freeze_variance: with ``torch.optim.Adam`` or ``AdamW``, Keras' ``Adam`` or
            ``AdamW`` (Keras 3, tf_keras and its legacy Adam): "auto"
            (default: 20 steps, then refreshed; 200 with ``refresh_variance=False``),
            or N: exact Adam for the first N steps (dense
            averages), then Adam's second moment is frozen (1-bit Adam, Tang et al.
            2021), which makes its update momentum SGD with a fixed preconditioner, and
            DGC takes over its first moment as it does SGD's momentum (momentum
            correction, masking), and ``delay`` and ``period`` (PyTorch and Keras)
            apply from the freeze on; the density schedule starts at the
            freeze (with ``compression=Compression.dgc`` and no ``density`` or
            ``warmup``: SGD's default stages, counted from the freeze; hvd_dgc/adam.py).
            With ``compression`` Horovod's none/fp16 or not given and none of
            ``density``, ``warmup``, ``warmup_unit``, ``warmup_densities`` and
            ``aggregation`` (DGC's top-k) given, the scaled sign of the memory after the
            freeze (1-bit Adam), and with no ``delay`` or ``period`` given an exchange
            every 4th step (``period=4``), each rank stepping on its own between: 0/1
            Adam (Lu et al., ICLR 2023); where the sign would save nothing on the link,
            exact Adam every step, as Horovod (adam.py ``ZERO_ONE_PERIOD``). With a
            compressor of its own collectives (``Compression.sign``: 1-bit Adam itself;
            PowerSGD, QSGD, ...) every tensor goes dense to the freeze, then through the
            compressor.
            False: Adam's own update on error feedback (no delay, no period).
        refresh_variance: with the variance frozen: None (default: "auto" with
            the default freeze, False with a freeze_variance=N the script chose),
            False (frozen once), "auto" (refreshed at steps 2T, 4T, 8T, ... of a
            freeze at step T) or k (every k steps after the freeze). Each rank tracks
            an estimate of exact Adam's second moment from its own gradients (its
            square over the world size plus its product with the previous one, so the
            batches' noise counts as in the ranks' average); at a refresh the ranks
            average it (one dense exchange, counted in the bytes sent) and the
            preconditioner, and what the memory holds, move to it (0/1 Adam, Lu et
            al., ICLR 2023; hvd_dgc/adam.py).
    """

    density: Any = None
    warmup: Optional[float] = None
    warmup_unit: str = "epoch"
    warmup_densities: Optional[tuple] = None
    min_compress_size: int = 1024
    momentum_masking: Any = "auto"
    clip_norm: Optional[float] = None
    cost_model: Any = None  # a CostModel, "measure" or None
    link_watch: Any = None  # None, False or a LinkWatch
    timeline: Optional[bool] = None  # None (on where it applies) or False
    delay: Any = 0
    period: int = 1
    skip_nonfinite: bool = True
    aggregation: str = "auto"
    fusion_threshold: Optional[int] = None
    log_every: int = 0
    verbose: bool = False
    freeze_variance: Any = "auto"
    refresh_variance: Any = None

    def __post_init__(self):
        if self.warmup_densities is not None:
            object.__setattr__(self, "warmup_densities", tuple(self.warmup_densities))
        check_options(self)

    @classmethod
    def names(cls):
        return [f.name for f in fields(cls)]

    @classmethod
    def from_options(cls, options, framework, caller):
        """The config of a call's keyword ``options``; ``caller`` names the function in
        messages. Unknown options and those ``framework`` does not run are refused."""
        known = cls.names()
        unknown = sorted(set(options) - set(known))
        if unknown:
            hints = []
            for name in unknown:
                close = difflib.get_close_matches(name, known, n=1)
                hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise TypeError(f"{caller}() got unexpected keyword argument(s) "
                            f"{', '.join(hints)}; hvd_dgc's options are {', '.join(known)} "
                            f"(hvd_dgc.config.DGCConfig)")
        config = cls(**options)
        problem = unsupported_message(config, framework)
        if problem:
            raise ValueError(problem)
        object.__setattr__(config, "_given", frozenset(options))
        return config

    def replace(self, **changes):
        out = replace(self, **changes)
        if hasattr(self, "_given"):  # what the script passed stays what it passed
            object.__setattr__(out, "_given", self._given)
        return out

    @property
    def given(self):
        """The options the script passed (``from_options``); for a config made directly,
        those that differ from their defaults."""
        if hasattr(self, "_given"):
            return self._given
        return frozenset(f.name for f in fields(self) if getattr(self, f.name) != f.default)

    @property
    def asks_topk(self):
        """The script passed an option of DGC's top-k (``TOPK_OPTIONS``: a density, its
        warm-up, how records are summed)."""
        return bool(self.given & TOPK_OPTIONS)

    @property
    def asks_lagging(self):
        """The script passed ``delay`` or ``period`` (even 0 or 1: its own choice)."""
        return bool(self.given & LAGGING_OPTIONS)

    @property
    def fixed_delay(self):
        """The int delay, or None with ``delay="auto"``."""
        return as_auto_delay(self.delay)[0]

    @property
    def auto_delay(self):
        """The ``AutoDelay`` settings, or None with a fixed delay."""
        return as_auto_delay(self.delay)[1]

    @property
    def lagging(self):
        """The options that make a rank step with its own contribution before the
        average comes, in words ("" when none): they need an update linear in the
        gradient."""
        delay = "auto" if self.auto_delay is not None else self.delay
        return " and ".join([f"delay={delay}"] * bool(delay)
                            + [f"period={self.period}"] * (self.period > 1))

    @property
    def undo_lagging(self):
        return " and ".join(["delay=0"] * bool(self.delay) + ["period=1"] * (self.period > 1))

    def to_dict(self, shared=False):
        """JSON-able and equal on every rank that passed the same options (a callable's
        name, not its address; a schedule or cost model by its settings). ``shared``:
        only what must agree across ranks (``log_every`` and ``verbose`` may differ:
        rank 0 prints)."""
        out = {}
        for f in fields(self):
            if shared and f.name in _PER_RANK:
                continue
            value = getattr(self, f.name)
            config = getattr(value, "config", None)
            if isinstance(value, (AutoDelay, LinkWatch)):
                value = repr(value)
            elif callable(config):
                value = repr(config())
            elif callable(value):
                value = getattr(value, "__qualname__", repr(value))
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    def key(self):
        """Hashable and faithful: what TensorFlow's registry of exchanges is keyed on."""
        return repr(sorted(self.to_dict().items()))

    def resolve(self, framework, compression, horovod, optimizer=None, **wrapper):
        """What these options and a wrapper's arguments come to, checked (hvd_dgc/
        resolve.py ``resolve``): a ``Resolved``."""
        return resolve(self, framework, compression, horovod, optimizer, **wrapper)


class CompressorOptions:
    """Mixin of every hvd_dgc compressor, PyTorch's and TensorFlow's: ``name`` (the
    attribute of ``Compression``) and ``_options()`` (a dict the constructor accepts
    back). ``Compression.dgc`` and friends are ready instances; calling one returns a
    copy with some options changed, and an option it does not have is refused. Equal
    options, equal compressors, hashing alike (TensorFlow keys caches on them; the
    optimizers compare configurations across ranks)."""

    name = "compressor"

    def _options(self):
        raise NotImplementedError

    def __call__(self, **options):
        """A copy with some options changed: ``Compression.dgc(sample_ratio=0.001)``."""
        merged = self._options()
        unknown = set(options) - set(merged)
        if unknown:
            raise TypeError(f"Compression.{self.name} has no option(s) {sorted(unknown)}; "
                            f"options are {sorted(merged)}")
        merged.update(options)
        return type(self)(**merged)

    def config(self):
        return (type(self).__name__, tuple(sorted(self._options().items())))

    def __repr__(self):
        opts = ", ".join(f"{k}={v!r}" for k, v in sorted(self._options().items()))
        return f"Compression.{self.name}({opts})"

    def __eq__(self, other):
        return type(self) is type(other) and self.config() == other.config()

    def __hash__(self):
        return hash(self.config())


#: Options a rank may set alone: they change no collective.
_PER_RANK = ("log_every", "verbose")

#: Options that ask for DGC's top-k. Adam and AdamW taken over, with ``compression``
#: Horovod's none/fp16 or not given, send the sign (1-bit Adam) where the script passes
#: none of them, and at 0/1 Adam's period where it passes none of ``LAGGING_OPTIONS``
#: either (adam.py ``ZERO_ONE_PERIOD``).
TOPK_OPTIONS = frozenset({"density", "warmup", "warmup_unit", "warmup_densities",
                          "aggregation"})
LAGGING_OPTIONS = frozenset({"delay", "period"})

#: What runs in hvd_dgc.torch only so far, and what to pass instead elsewhere:
#: (option, used(config), instead).
_TORCH_ONLY = ()


def check_options(config):
    """Each option's value checked, the message naming the option and the fix."""
    if config.warmup_unit not in ("epoch", "step"):  # checked even where unused
        raise ValueError(f"warmup unit must be 'epoch' or 'step', got "
                         f"{config.warmup_unit!r}")
    as_schedule(config.density, config.warmup, config.warmup_unit, config.warmup_densities)
    _check_int("min_compress_size", config.min_compress_size, 0,
               "tensors with fewer elements go dense")
    check_masking(config.momentum_masking)
    if config.clip_norm is not None and (isinstance(config.clip_norm, bool) or not isinstance(
            config.clip_norm, (int, float)) or not config.clip_norm > 0):
        raise ValueError(f"clip_norm must be a number > 0 (or None to disable), got "
                         f"{config.clip_norm!r}")
    if config.cost_model is not None and config.cost_model != "measure" and \
            not isinstance(config.cost_model, CostModel):
        raise TypeError(f"cost_model must be a hvd_dgc.CostModel(alpha=..., "
                        f"bandwidth=...) or 'measure' (the link timed at wrap time), "
                        f"got {config.cost_model!r}")
    as_link_watch(config.link_watch)
    if config.timeline not in (None, True, False):
        raise ValueError(f"timeline must be None (the default: the backward pass timed "
                         f"and the step's timeline tried against the cost model's "
                         f"sums, PyTorch) or False (the sums' plan throughout), got "
                         f"{config.timeline!r}")
    as_auto_delay(config.delay)
    _check_int("period", config.period, 1,
               "exchange every period-th step; 1 = every step")
    if not isinstance(config.skip_nonfinite, bool):
        raise ValueError(f"skip_nonfinite must be True or False, got "
                         f"{config.skip_nonfinite!r}")
    if not isinstance(config.aggregation, str) or config.aggregation not in AGGREGATION_OPTIONS:
        raise ValueError(f"aggregation must be one of {sorted(AGGREGATION_OPTIONS)}, got "
                         f"{config.aggregation!r}")
    if config.fusion_threshold is not None:
        _check_int("fusion_threshold", config.fusion_threshold, 0,
                   "bytes; 0: each tensor leaves from its own hook")
    _check_int("log_every", config.log_every, 0, "steps between statistics; 0: never")
    if not isinstance(config.verbose, bool):
        raise ValueError(f"verbose must be True (the full plan on rank 0) or False (one "
                         f"short line), got {config.verbose!r}")
    check_freeze_variance(config.freeze_variance)
    check_refresh_variance(config.refresh_variance)


def unsupported_message(config, framework):
    """Why ``framework`` cannot run ``config``, or None."""
    if framework == "torch":
        return None
    for name, used, instead in _TORCH_ONLY:
        if used(config):
            return (f"{name}={getattr(config, name)!r} runs in hvd_dgc.torch only so far; "
                    f"in hvd_dgc.{framework} use {instead}.")
    return None


def _check_int(name, value, low, meaning):
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low} ({meaning}), got {value!r}")
