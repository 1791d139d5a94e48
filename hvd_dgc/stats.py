"""Compression statistics: what was sent, against what dense fp32 would have sent.

Counts only this rank's contribution (the bytes it puts on the wire per
collective), which is what the paper's compression ratio measures; and why each byte
went (``CAUSES``, ``cause_of``), so a user sees what their ratio is made of.
"""

from collections import Counter

from hvd_dgc.paths import PathKind

__all__ = ["CompressionStats", "CAUSES", "RECORDS", "cause_of", "split_records", "REFRESH"]

#: Why bytes went, in the order the line names them:
#: positions, values: DGC's selected coordinates (allgather, region reduce, hierarchical):
#: where they lie (coded on PyTorch's allgather: packing.index_bytes; an int32 each
#: elsewhere) and their values (8 bits and a scale per tensor on PyTorch's allgather);
#: large tensors dense: a tensor DGC could compress sent whole (a warm-up stage or the
#: cost model chose dense, or Adam before its freeze);
#: small tensors dense: under ``min_compress_size``, sent whole every step;
#: payloads: a compressor's own collectives (PowerSGD, sign, QSGD, ...);
#: sparse gradients: embedding rows allgathered as Horovod does;
#: refresh: Adam's second moments averaged (``refresh_variance``);
#: records: positions and values together, in statistics a checkpoint saved before they
#: were told apart.
CAUSES = ("positions", "values", "large tensors dense", "small tensors dense", "payloads",
          "sparse gradients", "refresh", "records")

#: ``cause_of``'s answer for DGC's records, which ``CompressionStats`` splits into
#: "positions" and "values"
RECORDS = "records"

#: the name ``add_bytes`` takes for Adam's variance refresh
REFRESH = "hvd_dgc.adam_refresh"


def cause_of(path, numel, min_compress_size):
    """Why a tensor's bytes on ``path`` (a ``PathKind`` or its value; a compressor's name
    where it runs its own collectives) went."""
    try:
        kind = PathKind(path)
    except ValueError:  # PowerSGD, sign, ...: the statistics count them by name
        return "payloads"
    if kind is PathKind.DENSE:
        return "small tensors dense" if numel < min_compress_size else "large tensors dense"
    if kind.sums_records:
        return RECORDS
    return "sparse gradients" if kind is PathKind.SPARSE_GRAD else "payloads"


def split_records(cause, bytes_sent, positions):
    """``{cause: bytes}`` of ``bytes_sent`` that went for ``cause``: DGC's records
    (``RECORDS``) split into their ``positions`` and the rest, their values."""
    if cause != RECORDS:
        return {cause: bytes_sent}
    return {"positions": positions, "values": bytes_sent - positions}


class CompressionStats:
    """Running totals over steps, plus the last step alone.

    ``record`` is called once per tensor per step; ``end_step`` closes a step.
    ``min_compress_size``: the tensors below it are the "small tensors" of
    ``bytes_by_cause``.
    """

    def __init__(self, min_compress_size=1024):
        self.min_compress_size = min_compress_size
        self.reset()

    def reset(self):
        self.steps = 0
        self.bytes_sent = 0
        self.dense_bytes = 0
        self.elements_sent = 0
        self.elements_total = 0
        self.paths = Counter()
        self.by_cause = Counter()  # bytes sent, by why (CAUSES)
        self.returned_elements = 0  # region reduce: sums an owner put back into its residual
        self.launches = 0  # Horovod operations started (a grouped one once), first rounds
        self.fp16_clipped = 0  # dense fp16 values sent clipped to fp16wire.fp16_bound
        self.last = {}
        self.last_launches = 0
        self._current = {}
        self._current_launches = 0

    def record(self, name, path, numel, elements_sent, bytes_sent, density, positions=0):
        """One tensor's step on ``path``; ``positions``: of ``bytes_sent``, those that
        say where DGC's records lie (the rest: their values)."""
        path = getattr(path, "value", path)  # a PathKind counts under its plain name
        self.bytes_sent += bytes_sent
        self.dense_bytes += 4 * numel
        self.elements_sent += elements_sent
        self.elements_total += numel
        self.paths[path] += 1
        cause = cause_of(path, numel, self.min_compress_size)
        self.by_cause.update(split_records(cause, bytes_sent, positions))
        self._current[name] = {"path": path, "numel": numel, "sent": elements_sent,
                               "bytes": bytes_sent, "density": density, "cause": cause}

    def add_bytes(self, name, bytes_sent, positions=0):
        """More bytes this step for ``name`` (a tensor's, known only after a later round,
        ``positions`` of them where records lie; or ``REFRESH``, Adam's variance
        refresh)."""
        self.bytes_sent += bytes_sent
        if name in self._current:
            self._current[name]["bytes"] += bytes_sent
        cause = self._current[name]["cause"] if name in self._current else \
            "refresh" if name == REFRESH else "payloads"
        self.by_cause.update(split_records(cause, bytes_sent, positions))

    def add_received(self, name, received):
        """Bytes ``name`` received this step where a path counts them as they arrive
        (region reduce's, which depend on where the others' records fall)."""
        if name in self._current:
            self._current[name]["received"] = self._current[name].get("received", 0) + \
                received

    def add_returned(self, elements):
        self.returned_elements += elements

    def add_fp16_clipped(self, count):
        self.fp16_clipped += count

    def add_launches(self, count):
        """``count`` Horovod operations started: each a negotiation round of Horovod's
        controller at least, the latency a step pays on a slow link."""
        self.launches += count
        self._current_launches += count

    def end_step(self):
        if self._current:
            self.steps += 1
            self.last = self._current
            self.last_launches = self._current_launches
            self._current = {}
            self._current_launches = 0

    @staticmethod
    def _summary(bytes_sent, dense_bytes, sent, total):
        return {
            "bytes_sent": bytes_sent,
            "dense_fp32_bytes": dense_bytes,
            "compression_ratio": (dense_bytes / bytes_sent) if bytes_sent else float("inf"),
            "density": (sent / total) if total else 0.0,
        }

    def summary(self):
        """Totals since the last reset and for the last step, as plain numbers."""
        out = self._summary(self.bytes_sent, self.dense_bytes, self.elements_sent,
                            self.elements_total)
        out["steps"] = self.steps
        out["paths"] = dict(self.paths)
        out["bytes_by_cause"] = self.causes()
        out["returned_elements"] = self.returned_elements
        out["launches"] = self.launches
        out["fp16_clipped"] = self.fp16_clipped
        last = self.last.values()
        out["last_step"] = self._summary(sum(t["bytes"] for t in last),
                                         sum(4 * t["numel"] for t in last),
                                         sum(t["sent"] for t in last),
                                         sum(t["numel"] for t in last))
        out["last_step"]["tensors"] = {k: dict(v) for k, v in self.last.items()}
        out["last_step"]["launches"] = self.last_launches
        return out

    def causes(self):
        """``{cause: bytes sent}`` since the last reset, in ``CAUSES`` order, those with
        none left out."""
        return {c: self.by_cause[c] for c in CAUSES if self.by_cause[c]}

    def format(self, density=None):
        """The statistics in one line, each figure labelled per step or cumulative:
        ``density``: the density in effect this step (the schedule's; omitted if None),
        the bytes of the last step (where it is kept), and the totals since the start."""
        s = self.summary()
        words = [] if density is None else [f"density {density:.4g} now"]
        sent = [f"{s['bytes_sent'] / 1e6:.3f} MB in {s['steps']} steps"]
        if self.last:
            sent.insert(0, f"{s['last_step']['bytes_sent'] / 1e6:.3f} MB this step")
        ratio = s["compression_ratio"]
        less = f"{ratio:.1f}x less than dense fp32" if ratio != float("inf") else "nothing sent"
        words.append("sent " + ", ".join(sent) + f" ({less})")
        known = sum(s["bytes_by_cause"].values())  # (TF: since this process began)
        if known:
            words.append("of which " + ", ".join(
                f"{cause} {100 * n / known:.0f}%"
                for cause, n in s["bytes_by_cause"].items()))
        words.append(f"paths in {s['steps']} steps {s['paths']}")
        return "; ".join(words)

    def state_dict(self):
        return {"steps": self.steps, "bytes_sent": self.bytes_sent,
                "dense_bytes": self.dense_bytes, "elements_sent": self.elements_sent,
                "elements_total": self.elements_total, "paths": dict(self.paths),
                "returned_elements": self.returned_elements, "launches": self.launches,
                "fp16_clipped": self.fp16_clipped, "bytes_by_cause": dict(self.by_cause)}

    def load_state_dict(self, state):
        self.reset()
        for key in ("steps", "bytes_sent", "dense_bytes", "elements_sent", "elements_total"):
            setattr(self, key, state[key])
        self.paths = Counter(state["paths"])
        self.returned_elements = state.get("returned_elements", 0)
        self.launches = state.get("launches", 0)
        self.fp16_clipped = state.get("fp16_clipped", 0)
        # (a checkpoint from before the causes were counted: none known)
        self.by_cause = Counter(state.get("bytes_by_cause", {}))
