"""Every rank must wrap with the same settings and tensors, or Horovod's collectives
would hang waiting for a rank that never joins. At wrap time every rank allgathers its
encoded config once (``check_consistent``, on the framework's seam: hvd_dgc/seam.py);
the comparison and the message live here."""

import json

__all__ = ["check_consistent", "check_same", "optimizer_consistency", "outer_consistency"]


def check_consistent(collectives, config, what):
    """``config`` (a dict of JSON values) allgathered over ``collectives`` (one
    collective, every rank at the same point) and compared: ValueError naming each
    setting that differs, and where."""
    blob = json.dumps(config, sort_keys=True, default=repr).encode()
    configs = [json.loads(b.decode()) for b in
               collectives.allgather_bytes(blob, "hvd_dgc.config")]
    check_same(configs, collectives.ranks, what)


def optimizer_consistency(planner, **extra):
    """What every rank's DGC optimizer must agree on (``check_consistent``'s ``config``):
    the options, what they resolved to (``planner.resolved``), the cost model and the
    tensors, with the framework's ``extra`` (Horovod's arguments, the momentum)."""
    r = planner.resolved
    config = r.config.to_dict(shared=True)
    config.update({
        "compression": repr(getattr(r.compressor, "config", lambda: r.compressor)()),
        "dense_fp16": r.dense_fp16,
        "density": repr(r.schedule.config()) if hasattr(r.schedule, "config")
        else getattr(r.schedule, "__qualname__", repr(r.schedule)),
        "cost_model": "measure" if planner.measure else repr(planner.cost_model.config()),
        "tensors": [[t.name, list(t.shape)] for t in planner.tensors],
        "sparse_gradients": [t.name for t in planner.tensors if t.sliced],
    })
    config.update(extra)
    return config


def outer_consistency(outer, density, min_compress_size, names, shapes):
    """What every rank's outer loop must agree on (``check_consistent``'s ``config``):
    its settings and the tensors it averages, by name and shape."""
    return {"outer": list(outer), "density": density,
            "min_compress_size": min_compress_size,
            "tensors": [[n, list(s)] for n, s in zip(names, shapes)]}


def check_same(configs, ranks, what):
    """Raise ValueError naming every setting that differs between ranks."""
    diffs = []
    for key in sorted(set().union(*configs)):
        values = [c.get(key) for c in configs]
        if all(v == values[0] for v in values[1:]):
            continue
        if isinstance(values[0], dict):  # per-tensor shapes: name the tensors
            names = sorted({n for v in values for n in (v or {})
                            if len({json.dumps((v2 or {}).get(n)) for v2 in values}) > 1})
            diffs.append("%s differ for %s" % (key, ", ".join(names[:5])))
        elif isinstance(values[0], list):  # tensor names: name what is not everywhere
            sets = [set(map(json.dumps, v or [])) for v in values]
            odd = sorted(set().union(*sets) - set.intersection(*sets))
            diffs.append("%s differ (e.g. %s)" % (key, ", ".join(odd[:5])))
        else:
            diffs.append("%s: %s" % (key, ", ".join(
                f"rank {r}={v}" for r, v in zip(ranks, values))))
    if diffs:
        raise ValueError(f"hvd_dgc: {what} was configured differently on different ranks, "
                         f"which would hang Horovod's collectives: " + "; ".join(diffs)
                         + ". Pass the same arguments on every rank.")
