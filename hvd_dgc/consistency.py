"""Every rank must wrap with the same settings and tensors, or Horovod's collectives
would hang waiting for a rank that never joins. Each framework allgathers the
encoded config once at wrap time; the comparison and the message live here."""

import json

__all__ = ["encode", "decode_all", "check_same"]


def encode(config):
    return json.dumps(config, sort_keys=True, default=repr).encode()


def decode_all(sizes, everything):
    """Split the allgathered bytes (``everything``) by the allgathered ``sizes``."""
    configs, offset = [], 0
    for size in sizes:
        configs.append(json.loads(bytes(everything[offset:offset + size]).decode()))
        offset += size
    return configs


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
