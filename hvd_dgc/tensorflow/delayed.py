"""Delayed gradient averaging (Zhu et al., NeurIPS 2021) for TensorFlow.

A TF step runs its graph to completion, and Horovod's TF collectives return no
handle that outlives it, so the collectives cannot simply be left in flight
inside the graph. Instead the graph hands each step's payloads to worker
threads (``tf.py_function``), which run Horovod's eager collectives while the
next steps compute, and asks for the step launched ``delay`` steps ago, which
is long done unless the link is slower than ``delay`` steps of compute:

    step i (graph):  own_i, payload_i = path.take_own(g_i)   hvd_dgc/tensorflow/paths.py
                     launch(i, payload_i)                  -> threads: each path's launch,
                                                              advance, collect, correction
                     c = correction(i - D)                 avg_(i-D) - own_(i-D)
                     update_i = own_i + c                  fed to the optimizer

Up to D+1 steps' collectives run at once (one thread for each path a step uses:
one grouped collective of its tensors), so Horovod negotiates and moves them together, as
it does for the PyTorch side's asynchronous handles: one thread in turn would
pay every step's round trips one after another. The threads take the
collectives in launch order, the same on every rank, so they always meet.
Each runs as a small tf.function (eager Horovod ops cannot overlap: see
``WorkerThreads``), which needs a second inter-op thread: the step's graph holds
one while it waits (checked when the exchange is built).

What a path gives back to this rank's residual (region reduce's owners: their unsent
sums) goes into the memory when the graph takes step i-D's correction (as the PyTorch
side does when it collects).

The correction is exact for optimizers whose update is linear in the gradient
(SGD, or Adam with its variance frozen: tensorflow/adam.py); with the Keras optimizer DGC
takes SGD's momentum (or frozen Adam's first moment) over, as on the PyTorch side.
Adam's exact warm-up steps before the freeze are not linear, so the exchange runs
them synchronously (exchange.py ``_step``) and delays from the freeze on.
"""

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import tensorflow as tf
import horovod.tensorflow as _hvd
from horovod.tensorflow.mpi_ops import Max

from hvd_dgc.autodelay import AutoDelayState
from hvd_dgc.lagging import InFlight, LagQueue, StepSize
from hvd_dgc.stats import RECORDS
from hvd_dgc.tensorflow.paths import NO_DENSE, NO_RECORDS, Correction, Part, later_positions

__all__ = ["DelayedAveraging", "OwnStepsInCheckpoint", "WorkerThreads",
           "check_inter_op_threads"]


class DelayedAveraging(LagQueue):
    """The collectives of one exchange's last ``delay`` steps, in flight; with
    ``period`` > 1 the steps between exchanges too (their own updates, taken back when
    the exchange's average is applied), on the queue both frameworks share
    (hvd_dgc/lagging.py: when each step's entry is due).

    ``paths``: the exchange's ``ExchangePaths``. Payloads reach the threads as flat int32
    tensors (each path's ``to_words``), so one ``tf.switch_case`` can return any; the
    stage tells which path each tensor took. Only the collectives and cheap work run on
    the threads; the scatter into dense tensors happens in the graph, as on the
    synchronous path."""

    def __init__(self, paths, delay, variables, period=1, auto=None):
        """``delay``: the fixed D; ``auto``: delay="auto"'s ``AutoDelay`` instead (the D
        chosen from measured compute and waits, hvd_dgc/autodelay.py)."""
        said = "auto" if auto is not None else delay
        setting = " and ".join([f"delay={said}"] * bool(said)
                               + [f"period={period}"] * (period > 1))
        check_inter_op_threads(setting, "delay=0 and period=1")
        super().__init__(period)
        self.paths, self._fixed = paths, int(delay or 0)
        self.auto = None if auto is None else AutoDelayState(auto)
        # exchanges in flight at once are fewer than this: their collectives' names
        self._slots = (self._fixed if auto is None else auto.max_delay) + 1
        self.variables = list(variables)  # for flush(); not tracked by any checkpoint
        self.gives_back = paths.gives_back()
        self._threads = WorkerThreads(3 * self._slots, paths.ctx.wire.process_set)
        self._step_ended = None  # delay="auto": when the last step's wait ended
        self._agreeing = None    # delay="auto": a window's sums, being agreed on (Future)
        self._kept = None        # delay="auto": (its tf.Variable, the D last written)
        self._owed = None        # own steps a checkpoint carried, due with their exchange
        #                          (an InFlight's launches and size)
        # per tensor, the sum of log(1 - lr wd) of the optimizer's decoupled decays
        self._log_decay = np.zeros(len(paths.ctx.tensors), np.float64)

    @property
    def delay(self):
        """The D in force: the fixed one, or delay="auto"'s last decision."""
        return self._fixed if self.auto is None else self.auto.delay

    def describe_delay(self):
        """For the rank-0 line."""
        if self.auto is None:
            return self._fixed
        return f"auto (from {self.auto.config.start}, at most {self.auto.config.max_delay})"

    def stats(self):
        """What ``compression_stats()`` says of the lag: the D in force, the period, and
        delay="auto"'s decisions ``(step, D)``."""
        out = {"delay": self.delay, "period": self.period}
        if self.auto is not None:
            out["delay_decisions"] = list(self.auto.decisions)
        return out

    @property
    def in_flight(self):
        """Steps whose averages have not been applied yet (own steps a checkpoint carried
        count as one until the next step takes them in)."""
        return len(self.inflight) + (self._owed is not None)

    # -- a period's own steps, in a checkpoint (OwnStepsInCheckpoint) ------------------
    def owed(self):
        """``-own`` of this rank's steps since the last exchange, summed per tensor (flat
        float32) at the step size of the last of them, and that size's rate; None when
        nothing is in flight. A collective in flight (``delay``) cannot be saved, as the
        PyTorch side's ``state_dict()`` refuses it: ``flush()`` first."""
        if not self.inflight and self._owed is None:
            return None
        if not all(isinstance(future, _OwnSteps) for entry in self.inflight
                   for work in entry.launches for future in work):
            raise RuntimeError(
                f"hvd_dgc: {len(self.inflight)} step(s) await an average (delay="
                f"{self.delay}, period={self.period}); their averages cannot be saved. "
                f"Call opt.flush() (Keras) or hvd.flush(optimizer) (tape) after the step, "
                f"before writing the checkpoint.")
        pending = ([] if self._owed is None else [self._owed]) + list(self.inflight)
        last = pending[-1].size
        total = [np.zeros([t.numel], np.float32) for t in self.paths.ctx.tensors]
        for entry in pending:
            for work in entry.launches:
                for i, (t, c) in enumerate(zip(total, _result(self.paths.ctx.tensors,
                                                              work))):
                    _add_to(t, _scaled(c, self._factor(entry.size, last, i)))
        return total, (-1.0 if last is None else last[0].rate)

    def owe(self, owed, rate):
        """Own steps a restored checkpoint carried (``owed()``'s, at ``rate``), taken back
        with the exchange that ends their period, as if this run had taken them: pushed
        at the next step, the first after the restore."""
        work = [_OwnSteps({i: Correction(NO_RECORDS, part, NO_RECORDS)
                           for i, part in enumerate(owed) if part.size})]
        self._owed = InFlight(0, [work], self._sizes(rate))

    def _push_owed(self, step):
        if self._owed is not None:
            owed, self._owed = self._owed, None
            self.push(step, owed.launches, owed.size)

    # -- each step's size (hvd_dgc/lagging.py: own steps taken back at theirs) ----------
    def _sizes(self, rate):
        """Each tensor's ``StepSize`` now at ``rate`` (None: unknown, below 0: the tape's
        optimizer is not the exchange's to know)."""
        rate = float(rate)
        if rate < 0:
            return None
        return tuple(StepSize(rate, float(d)) for d in self._log_decay)

    def _factor(self, then, now, i):
        if then is None or now is None:
            return 1.0
        return self.take_back(then[i], now[i])

    def _taken_back(self, entries, now):
        """Each entry's corrections per tensor, times its step's size over ``now``'s."""
        return [[_scaled(c, self._factor(entry.size, now, i))
                 for i, c in enumerate(_result(self.paths.ctx.tensors, work))]
                for entry in entries for work in entry.launches]

    # -- delay="auto"'s D, in a checkpoint ----------------------------------------------
    def keep_delay_in(self, variable):
        """Write each D decided into ``variable`` (the exchange's, tracked: checkpoints
        and the elastic commit hold it), and go on from one a restore put there."""
        self._kept = (variable, int(variable.numpy()))
        self.resume_delay(int(variable.numpy()))

    def resume_delay(self, delay):
        """Go on from ``delay`` (a checkpoint's, or rank 0's after an elastic reset), from
        a fresh window of measurements, as the PyTorch side's ``resume_delay``."""
        self.auto.delay = int(delay)
        self.auto.reset_window()
        self._agreeing = self._step_ended = None
        self._write_delay()

    def _write_delay(self):
        if self._kept is not None and self._kept[1] != self.auto.delay:
            self._kept[0].assign(self.auto.delay)
            self._kept = (self._kept[0], self.auto.delay)

    def _adopt_restored(self):
        """A step's first act: a D a restore wrote into the variable is the D from now."""
        if self._kept is not None:
            stored = int(self._kept[0].numpy())
            if stored != self._kept[1]:
                self._kept = (self._kept[0], stored)
                self.resume_delay(stored)

    # -- the step's graph ------------------------------------------------------------
    def step(self, grads, at, dropped=None, size=None):
        """Launch this step's payloads; per tensor, ``own + avg - own`` of every step
        whose average is due now (the step launched ``delay`` steps ago; with
        ``period``, an exchange's average in place of its period's own steps), each
        times its step's size over this one's. ``dropped[i]``: tensor i is not finite on
        this rank; it sends nothing and its memory does not move. ``size``: ``(rate,
        decays)``, what the optimizer multiplies this step's update by and, per tensor,
        the ``lr wd`` of its decoupled decay before it (None: unknown, as with a tape)."""
        exchanging = None if self.period == 1 else \
            tf.equal((at.step + 1) % self.period, 0)
        sent = [self.paths.take_own(i, grad, at, None if dropped is None else dropped[i],
                                    exchanging) for i, grad in enumerate(grads)]
        owns = []  # a step between exchanges: its own updates, taken back when due
        if exchanging is not None:
            owns = [tf.cond(exchanging, lambda: tf.zeros([0]), lambda own=own: own)
                    for _, own in sent]
        flag = tf.constant(True) if exchanging is None else exchanging
        rate, decays = (tf.constant(-1.0), tf.zeros([len(grads)])) if size is None else size
        launched = tf.py_function(self.launch, [at.step, at.stage, flag, rate, decays]
                                  + [w for w, _ in sent] + owns, Tout=tf.int32)
        with tf.control_dependencies([launched]):
            parts = tf.py_function(self.correction, [at.step, rate],
                                   Tout=[tf.int32, tf.float32, tf.int32] * len(grads)
                                   + [tf.int64])
        ctx, out = self.paths.ctx, []
        for i, (grad, (_, own)) in enumerate(zip(grads, sent)):
            records, dense, returned = parts[3 * i: 3 * i + 3]
            records.set_shape([None, 2])
            # the dense part, or zeros, plus the records scattered (as the sync path does)
            base = tf.cond(tf.size(dense) > 0, lambda d=dense: d,
                           lambda n=ctx.numel(i): tf.zeros([n]))
            correction = tf.tensor_scatter_nd_add(base, records[:, :1],
                                                  tf.bitcast(records[:, 1], tf.float32))
            out.append(tf.reshape(own + tf.reshape(correction, [-1]), tf.shape(grad)))
            if self.gives_back:  # step i-D's records owed to this rank's residual
                returned.set_shape([None, 2])
                ctx.give_back(i, returned[:, 0], tf.bitcast(returned[:, 1], tf.float32))
        if self.gives_back:
            ctx.statistics.add(bytes_sent=parts[-1], cause=RECORDS,
                               positions=later_positions(ctx.compressor, parts[-1]))
        return out

    # -- called from the graph (tf.py_function) ---------------------------------
    def launch(self, step, stage, exchanging, rate, decays, *payloads):
        """Start an exchange's collectives on the threads, or (a step between
        exchanges) keep ``-own`` of each tensor for when the period's average comes;
        either with this step's size (``rate``, and the ``decays`` before it)."""
        step, stage, count = int(step), int(stage), len(self.paths.ctx.tensors)
        self._adopt_restored()
        self._push_owed(step)  # (a restored checkpoint's own steps come first)
        self._log_decay += np.log1p(-decays.numpy().astype(np.float64))
        arrays = [p.numpy() for p in payloads]
        if bool(exchanging):
            # a name per slot: exchanges in flight at once are fewer than delay + 1
            name = f"hvd_dgc.dga{((step + 1) // self.period) % self._slots}"
            work = [self._threads.exchange(path, name, members, ks, arrays)
                    for path, members, ks in self.paths.groups(stage)]
        else:
            work = [_OwnSteps({i: Correction(NO_RECORDS, -own, NO_RECORDS)
                               for i, own in enumerate(arrays[count:]) if own.size})]
        self.push(step, [work], self._sizes(rate))
        return np.int32(step)

    def correction(self, step, rate):
        """``avg - own`` of the launches due at ``step`` (``-own`` of a step between
        exchanges), per tensor as three parts: records to scatter and a dense part (the
        other one empty), and the records it gives back to this rank's residual; all
        empty where nothing is due (before the first, or flushed before a checkpoint
        this run resumed from). Each launch's, times its step's size over ``rate``'s
        (this step's). The graph turns them into one tensor. Last: the bytes this rank
        sent in later rounds."""
        started = time.perf_counter()
        parts = _summed(self.paths.ctx.tensors,
                        self._taken_back(self.due(int(step)), self._sizes(rate)))
        if self.auto is not None:
            self._tune(int(step), started, time.perf_counter() - started)
        return [x for c in parts for x in c[:3]] + [np.int64(sum(c.later_bytes for c in parts))]

    def _tune(self, step, started, waited):
        """delay="auto", as the PyTorch side (torch/delayed.py ``tune``): this step's
        compute (since the last step's wait ended) and wait; at the end of a window read
        the previous window's agreed sums (long arrived: no wait), decide D from them
        (every rank the same, from this step on), and start agreeing on this window's
        (max over ranks, on a thread)."""
        auto = self.auto
        if self._step_ended is not None:
            auto.observe(started - self._step_ended, waited)
        self._step_ended = time.perf_counter()
        if not auto.window_done():
            return
        sums = auto.take_window()
        if self._agreeing is not None:
            agreeing, self._agreeing = self._agreeing, None
            auto.decide(tuple(agreeing.result()), step, self.period)
            self._write_delay()
        self._agreeing = self._threads.agree_max(sums)
        self._step_ended = time.perf_counter()

    # -- elastic Horovod ----------------------------------------------------------------
    def abandon(self):
        """An elastic restore or reset: what is in flight belongs to a world that is gone
        (the commit it goes back to was flushed, so nothing of it is lost). Its
        collectives fail once Horovod shuts down; their threads are left to it, on a
        pool of their own, and the collectives' functions (traced for the old world's
        scales) are made again."""
        self.inflight.clear()
        self._owed = None
        self._agreeing = self._step_ended = None
        if self.auto is not None:
            self.auto.reset_window()
        self._threads.abandon()

    # -- end of training, evaluation, checkpoint ----------------------------------
    def drain(self, rate=-1.0):
        """Wait for every launch still in flight; the sum of their corrections per
        tensor (flat float32), each times its step's size over the flush's (``rate``:
        what the flush multiplies them by; below 0 unknown), or None when nothing was
        in flight."""
        self._step_ended = None  # (delay="auto": a flush's wait is not a step's compute)
        self._push_owed(0)
        if not self.inflight:
            return None
        ctx = self.paths.ctx
        total = [np.zeros([t.numel], np.float32) for t in ctx.tensors]
        for launch in self._taken_back(self.due(0, flush=True), self._sizes(rate)):
            for i, (t, c) in enumerate(zip(total, launch)):
                _add_to(t, c)
                if self.gives_back:
                    ctx.give_back(i, c.returned[:, 0],
                                  tf.constant(c.returned[:, 1].view(np.float32)))
                    ctx.statistics.add(bytes_sent=c.later_bytes, cause=RECORDS,
                                       positions=later_positions(ctx.compressor,
                                                                 c.later_bytes))
        return total


class WorkerThreads:
    """Where delayed averaging's collectives run while the next steps compute: a pool of
    threads (one path's collectives of one launch each), a serial one for a path whose
    exchanges read what the last one left (the sign's server errors: one after another,
    in launch order), and each collective as a small tf.function with graph nodes of its
    own. Eager Horovod ops are all named after their op type (TF's eager kernels ignore
    ``name=``), so two eager allgathers in flight at once would collide."""

    def __init__(self, workers, process_set):
        self.workers, self.process_set = workers, process_set
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="hvd_dgc_dga")
        self._serial = ThreadPoolExecutor(1, thread_name_prefix="hvd_dgc_dga_serial")
        self._functions = {}  # (name, path, members) -> tf.function of its collectives

    def exchange(self, path, name, members, ks, arrays):
        """A Future of ``path``'s corrections for ``members`` (``{index: Correction}``):
        its collectives of their payloads (flat words, ``arrays``), and only cheap work
        besides."""
        return (self._serial if path.serial else self._pool).submit(
            self._run, path, name, members, ks, arrays)

    def agree_max(self, sums):
        """A Future of the elementwise maximum of every rank's ``sums`` (delay="auto"'s
        window, hvd_dgc/autodelay.py)."""
        return self._pool.submit(self._agree, sums)

    def abandon(self):
        """An elastic restore or reset: the threads in flight are left to a Horovod
        that shuts down, on pools of their own; the functions (traced for the old
        world's scales) are made again."""
        old, self._pool = self._pool, ThreadPoolExecutor(self.workers,
                                                         thread_name_prefix="hvd_dgc_dga")
        old.shutdown(wait=False, cancel_futures=True)
        old, self._serial = self._serial, ThreadPoolExecutor(
            1, thread_name_prefix="hvd_dgc_dga_serial")
        old.shutdown(wait=False, cancel_futures=True)
        self._functions = {}

    def _run(self, path, name, members, ks, arrays):
        payloads = tuple(path.from_words(arrays[i], i) for i in members)
        got = self._function(path, name, members)(ks, *payloads)
        return path.correction(Part(name, members, payloads, ks), got)

    def _function(self, path, name, members):
        """The path's collectives of ``members`` as a tf.function."""
        key = (name, path.kind, members)
        fn = self._functions.get(key)
        if fn is None:
            def run(ks, *payloads):
                handle = path.launch(Part(name, members, payloads, ks))
                path.advance(handle)
                return path.collect(handle)
            fn = tf.function(run, input_signature=[tf.TensorSpec([len(members)], tf.int32)]
                             + [path.spec(i) for i in members], autograph=False)
            self._functions[key] = fn
        return fn

    def _agree(self, sums):
        fn = self._functions.get("autodelay")
        if fn is None:
            process_set = self.process_set
            fn = tf.function(lambda x: _hvd.allreduce(x, op=Max, name="hvd_dgc.autodelay",
                                                      process_set=process_set),
                             input_signature=[tf.TensorSpec([len(sums)], tf.float64)],
                             autograph=False)
            self._functions["autodelay"] = fn
        return fn(tf.constant(sums, tf.float64)).numpy().tolist()


def _result(tensors, futures):
    """One ``Correction`` per tensor from a launch's futures (empty where none has one)."""
    parts = [Correction(NO_RECORDS, NO_DENSE, NO_RECORDS)] * len(tensors)
    for future in futures:
        for i, correction in future.result().items():
            parts[i] = correction
    return parts


def _summed(tensors, launches):
    """One ``Correction`` per tensor for several launches due at once (a period's
    steps): dense where more than one has something for the tensor."""
    if len(launches) <= 1:
        return launches[0] if launches else _result(tensors, [])
    out = []
    for i, t in enumerate(tensors):
        parts = [launch[i] for launch in launches]
        given = [c for c in parts if c.records.size or c.dense.size]
        if len(given) <= 1:
            summed = given[0] if given else parts[0]
            summed = summed._replace(returned=_joined([c.returned for c in parts]),
                                     later_bytes=sum(c.later_bytes for c in parts))
        else:
            total = np.zeros([t.numel], np.float32)
            for c in given:
                _add_to(total, c)
            summed = Correction(NO_RECORDS, total, _joined([c.returned for c in parts]),
                                sum(c.later_bytes for c in parts))
        out.append(summed)
    return out


class _OwnSteps(Future):
    """A step between exchanges (``period``): its ``-own`` per tensor, ready at once (no
    collective), applied with the exchange's average."""

    def __init__(self, corrections):
        super().__init__()
        self.set_result(corrections)


class OwnStepsInCheckpoint(tf.__internal__.tracking.Trackable):
    """This rank's own steps since the last exchange (``period`` > 1: 0/1 Adam, AdamW's
    default), in ``tf.train.Checkpoint`` with the rest of DGC's state: the weights a
    checkpoint holds include them, and the exchange that ends their period takes them
    back, so a run restored from it must take them back too (else each rank keeps its
    own steps for good, and the ranks' weights part). Written when the checkpoint is,
    read when it is restored (before the first step, as the memory); nothing is held
    in between. Checkpoints only: not a SavedModel's (GradientExchange leaves it out)."""

    def __init__(self, dga):
        self._dga = dga

    def _serialize_to_tensors(self):
        owed = self._dga.owed()
        values, rate = (np.concatenate(owed[0]), owed[1]) if owed else (NO_DENSE, -1.0)
        return {"values": tf.constant(values), "rate": tf.constant(rate, tf.float64)}

    def _restore_from_tensors(self, restored_tensors):
        values = restored_tensors["values"].numpy()
        rate = float(restored_tensors["rate"].numpy())
        if values.size == 0:
            return None
        numels = [t.numel for t in self._dga.paths.ctx.tensors]
        if values.size != sum(numels):
            raise ValueError(
                f"hvd_dgc: the checkpoint's own steps hold {values.size} values where this "
                f"model's exchanged variables have {sum(numels)}: it was written for "
                f"another model. Restore it into the model it was saved from.")
        self._dga.owe(np.split(values, np.cumsum(numels)[:-1]), rate)
        return None


def _scaled(correction, factor):
    """``correction``'s values times ``factor`` (what it gives back to the residual is
    not a step: as it is)."""
    if factor == 1.0:
        return correction
    f = np.float32(factor)
    records = correction.records
    if records.size:
        records = records.copy()
        records[:, 1] = (correction.records[:, 1].view(np.float32) * f).view(np.int32)
    dense = correction.dense * f if correction.dense.size else correction.dense
    return correction._replace(records=records, dense=dense)


def _add_to(total, correction):
    """``total += correction`` (its dense part, or its records scattered)."""
    if correction.dense.size:
        total += correction.dense
    elif correction.records.size:
        np.add.at(total, correction.records[:, 0], correction.records[:, 1].view(np.float32))


def _joined(records):
    """Several launches' records given back, as one array."""
    records = [r for r in records if r.size]
    return np.concatenate(records) if len(records) > 1 else (records[0] if records
                                                              else NO_RECORDS)


def check_inter_op_threads(setting, instead):
    """The step's graph holds one inter-op thread while it waits for an average launched
    earlier; the collectives' functions need another to start on."""
    configured = tf.config.threading.get_inter_op_parallelism_threads()
    threads = configured or os.cpu_count() or 1
    if threads < 2:
        raise RuntimeError(
            f"hvd_dgc: {setting} in TensorFlow needs at least 2 inter-op threads (this "
            f"process has {threads}{' (set by the user)' if configured else ', one per CPU'}): "
            f"one waits inside the training step for an average launched earlier, another "
            f"starts the collectives. Call tf.config.threading."
            f"set_inter_op_parallelism_threads(2) (or more) before TensorFlow runs anything, "
            f"or use {instead}.")
