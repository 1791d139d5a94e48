"""What every PyTorch compressor shares: options and identity (hvd_dgc/config.py's
CompressorOptions, as TensorFlow's), and its own random generators.

Randomness never touches the global RNG: each compressor owns a
``torch.Generator`` per device, seeded ``seed + 1000003 * rank`` (ranks draw
different streams), saved in the optimizer's checkpoint.
"""

import torch

from hvd_dgc.config import CompressorOptions

__all__ = ["Options"]


class Options(CompressorOptions):
    """hvd_dgc/config.py's CompressorOptions (options, copies, identity) plus
    ``self.seed``'s generators."""

    #: draws from its generators (a skipped step must put them back: guard.py)
    random = False

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
