"""This rank's compression statistics in TensorFlow: a record of named fields.

A step's graph counts them, so they are tf.Variables, and checkpoints have held them
since the first release as variables of the exchange, under the names kept here so
those checkpoints still restore:

    counters   [bytes_sent, dense_bytes, elements_sent, elements_total,
                steps on the allgather path, steps on the dense path]
    regioned   [steps on the region path, returned_elements]     where region may run
    gathered   steps of IndexedSlices gradients                  where there are some
    exchanged  steps of a compressor's own collectives           where one runs
    hierarchical  steps on hierarchical DGC                       where it may run
    nonfinite  steps skipped (or dropped) for a NaN/Inf gradient

and, outside the checkpoint (scratch, as ``fp16_clipped``), the bytes sent by why
(hvd_dgc/stats.py ``CAUSES``) since this process built the exchange.

Where each field lives is said once, in ``_WHERE``; everything else counts by name::

    statistics.count(PathKind.REGION, numel, sent, 8 * sent)
    statistics.add(bytes_sent=..., cause="records", positions=..., returned_elements=...)
"""

import sys

import tensorflow as tf

from hvd_dgc.fp16wire import clip_warning
from hvd_dgc.paths import PathKind
from hvd_dgc.stats import CAUSES, RECORDS, CompressionStats, cause_of

__all__ = ["Statistics", "FIELDS"]

#: the fields besides the paths' step counts (``PathKind``s)
FIELDS = ("bytes_sent", "dense_bytes", "elements_sent", "elements_total", "returned_elements",
          "nonfinite_steps")

#: field -> (the owner's attribute holding it, position there; None: a scalar)
_WHERE = {
    "bytes_sent": ("counters", 0), "dense_bytes": ("counters", 1),
    "elements_sent": ("counters", 2), "elements_total": ("counters", 3),
    PathKind.ALLGATHER: ("counters", 4), PathKind.DENSE: ("counters", 5),
    PathKind.REGION: ("regioned", 0), "returned_elements": ("regioned", 1),
    PathKind.SPARSE_GRAD: ("gathered", None), PathKind.EXCHANGE: ("exchanged", None),
    PathKind.HIERARCHICAL: ("hierarchical", None),
    "nonfinite_steps": ("nonfinite", None),
}


#: the owner's attribute -> (the tf.Variable's name, its length; 0: a scalar)
_STORES = {"counters": ("counters", 6), "regioned": ("region_counters", 2),
           "gathered": ("sparse_grad_steps", 0), "exchanged": ("exchange_steps", 0),
           "hierarchical": ("hierarchical_steps", 0),
           "nonfinite": ("nonfinite", 0)}


class Statistics:
    """The counters of one exchange (``owner``, the tf.Module whose checkpoint holds them).

    A field's variable is made when something can count in it: ``cover`` the paths a
    plan uses; a field without one is not counted (a set-up that never runs a path
    keeps the checkpoint layout it always had)."""

    def __init__(self, owner, paths=(), min_compress_size=1024):
        self.owner, self.min_compress_size = owner, min_compress_size
        with tf.init_scope():
            # dense fp16 values sent clipped (hvd_dgc/fp16wire.py): scratch, not checkpointed
            self.fp16_clipped = tf.Variable(0, dtype=tf.int64, trainable=False,
                                            name="fp16_clipped")
            # bytes by cause: scratch too (the checkpoint's layout stays as it was)
            self.causes = tf.Variable(tf.zeros([len(CAUSES)], tf.int64), trainable=False,
                                      name="bytes_by_cause")
        self.cover(("bytes_sent", "nonfinite_steps") + tuple(paths))

    def cover(self, fields):
        """Make the variables ``fields`` (names or PathKinds) are kept in, if not yet."""
        with tf.init_scope():
            for field in fields:
                where = _WHERE.get(field)
                if where is None or self._store(field) is not None:
                    continue
                name, size = _STORES[where[0]]
                zeros = tf.zeros([size], tf.int64) if size else tf.constant(0, tf.int64)
                setattr(self.owner, where[0], tf.Variable(zeros, trainable=False, name=name))

    def _store(self, field):
        where = _WHERE.get(field)
        return None if where is None else getattr(self.owner, where[0], None)

    # -- counting, in a step's graph (or eagerly) -------------------------------------
    def count(self, path, numel, sent, sent_bytes, positions=0):
        """One tensor's step on ``path``: ``sent`` of its ``numel`` elements left, in
        ``sent_bytes`` (dense fp32 would have sent ``4 numel``; ``numel`` a Python int),
        ``positions`` of them where DGC's records lie."""
        self.add((path,), cause=cause_of(path, numel, self.min_compress_size),
                 positions=positions, bytes_sent=sent_bytes, dense_bytes=4 * numel,
                 elements_sent=sent, elements_total=numel)

    def cause_of(self, path, numel):
        """Why a tensor's bytes on ``path`` went (hvd_dgc/stats.py ``cause_of``)."""
        return cause_of(path, numel, self.min_compress_size)

    def add(self, paths=(), cause=None, positions=0, **fields):
        """Add to fields by name, and one step to each of ``paths``; ``bytes_sent`` also
        to ``cause`` (hvd_dgc/stats.py ``cause_of``) where given: DGC's records
        (``RECORDS``) to "positions" (``positions`` of them) and "values"."""
        amounts = dict(fields)
        if cause is not None and "bytes_sent" in fields:
            sent = tf.cast(fields["bytes_sent"], tf.int64)
            where = tf.cast(positions, tf.int64)
            by = {"positions": where, "values": sent - where} if cause == RECORDS else \
                {cause: sent}
            self.causes.assign_add(tf.stack([by.get(c, tf.constant(0, tf.int64))
                                             for c in CAUSES]))
        amounts.update((path, 1) for path in paths)
        by_store = {}
        for field, amount in amounts.items():
            if self._store(field) is not None:
                attr, position = _WHERE[field]
                by_store.setdefault(attr, {})[position] = amount
        for attr, amounts in by_store.items():
            var = getattr(self.owner, attr)
            if None in amounts:
                var.assign_add(tf.cast(amounts[None], tf.int64))
            else:
                var.assign_add(tf.stack([tf.cast(amounts.get(j, 0), tf.int64)
                                         for j in range(int(var.shape[0]))]))

    def add_fp16_clipped(self, count):
        self.fp16_clipped.assign_add(count)

    def warn_fp16(self, before, step, bound):
        """The first step that sends dense fp16 values clipped at ``bound`` says so (as
        the PyTorch side's warning, printed from the graph); ``before``: the count
        before this step. Later ones are counted in ``fp16_clipped``."""
        template = clip_warning("tensorflow", "{}", "{}", bound) + \
            " Later ones are counted in stats()['fp16_clipped']."
        now = self.fp16_clipped.read_value()

        def say():
            tf.print(tf.strings.format(template, [step, now - before]),
                     output_stream=sys.stderr)
            return tf.constant(0)
        tf.cond(tf.logical_and(tf.equal(before, 0), now > 0), say, lambda: tf.constant(0))

    # -- a step undone (skip_nonfinite) -------------------------------------------------
    def save(self):
        """Every counter but ``nonfinite_steps``, before a step that may be undone."""
        saved = {attr: getattr(self.owner, attr).read_value() for attr in _STORES
                 if attr != "nonfinite" and getattr(self.owner, attr, None) is not None}
        saved["fp16_clipped"] = self.fp16_clipped.read_value()
        saved["causes"] = self.causes.read_value()
        return saved

    def restore(self, saved):
        scratch = {"fp16_clipped": self.fp16_clipped, "causes": self.causes}
        for attr, value in saved.items():
            (scratch[attr] if attr in scratch else getattr(self.owner, attr)).assign(value)

    # -- reading ------------------------------------------------------------------------
    def value(self, field):
        """A field's value now (0 where it has no variable)."""
        var = self._store(field)
        if var is None:
            return 0
        position = _WHERE[field][1]
        value = var.numpy()
        return int(value if position is None else value[position])

    def _loaded(self, steps):
        """The counters now, as the ``CompressionStats`` record both frameworks share."""
        stats = CompressionStats()
        totals = {field: self.value(field) for field in FIELDS}
        paths = {path.value: self.value(path) for path in PathKind if path in _WHERE}
        causes = dict(zip(CAUSES, self.causes.numpy().tolist()))
        stats.load_state_dict(dict(totals, steps=steps, fp16_clipped=int(
            self.fp16_clipped.numpy()), paths={k: n for k, n in paths.items() if n},
            bytes_by_cause=causes))
        return stats

    def summary(self, steps):
        """As ``hvd_dgc.stats.CompressionStats.summary`` (less the last step, which a
        graph does not keep), plus ``nonfinite_steps`` and ``fp16_clipped``."""
        out = self._loaded(steps).summary()
        out.pop("last_step")
        out.update(nonfinite_steps=self.value("nonfinite_steps"),
                   fp16_clipped=int(self.fp16_clipped.numpy()))
        return out

    def format(self, steps, density=None):
        """One line, as PyTorch's ``log_every`` prints it (``CompressionStats.format``:
        ``density`` the one in effect now; the bytes since the start, labelled so)."""
        return self._loaded(steps).format(density)
