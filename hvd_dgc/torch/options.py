"""What every hvd_dgc compressor shares: options, identity, and its own random generators.

``Compression.dgc`` and friends are ready instances; calling one returns a copy
with some options changed (``Compression.qsgd(levels=15)``). Two compressors
with the same class and options are equal and hash alike (TensorFlow keys
caches on them; the optimizer compares configurations across ranks).

Randomness never touches the global RNG: each compressor owns a
``torch.Generator`` per device, seeded ``seed + 1000003 * rank`` (ranks draw
different streams), saved in the optimizer's checkpoint.
"""

import torch

__all__ = ["Options"]


class Options:
    """Mixin: ``name`` (the attribute of ``Compression``), ``_options()`` (a dict
    that the constructor accepts back), and ``self.seed``."""

    name = "compressor"

    def _options(self):
        raise NotImplementedError

    def __call__(self, **options):
        """A copy with some options changed: ``Compression.dgc(fp16_values=True)``."""
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

    # -- randomness (never the global RNG) --------------------------------
    def generator(self, device, rank=0):
        generators = self.__dict__.setdefault("_generators", {})
        key = str(device)
        gen = generators.get(key)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.seed + 1000003 * rank)
            generators[key] = gen
        return gen

    def state_dict(self):
        generators = self.__dict__.get("_generators", {})
        return {"generators": {k: g.get_state() for k, g in generators.items()}}

    def load_state_dict(self, state, rank=0):
        for key, gstate in state.get("generators", {}).items():
            self.generator(key, rank).set_state(gstate)
