"""One tensor's DGC memory, on the flat memory the exchange uses (hvd_dgc/torch/memory.py):
what the maths tests call, one block of one tensor."""

import torch

from hvd_dgc.torch.memory import FlatMemory, Run


class OneTensor:
    """``FlatMemory`` holding one flat tensor of ``numel`` elements (aligned, as a sparse
    tensor's slice is in a launch)."""

    def __init__(self, numel, masking=True, momentum=0.0, nesterov=False):
        self.numel, self.masking = numel, masking
        self.momentum, self.nesterov = momentum, nesterov
        self.memory = FlatMemory(masking)
        self.block = self.memory.block(("w",), (numel,), 1)
        self.g = torch.zeros(self.block.total)

    def accumulate(self, g, with_block_max=False):
        """``v`` (a view) after folding ``g`` in; with ``with_block_max`` also the block
        maxima of the tensor's full blocks."""
        self.g[:self.numel] = g.reshape(-1)
        runs = [Run(0, self.block.total, self.momentum, self.nesterov)]
        v = self.memory.accumulate(self.block, self.g, runs, with_block_max)
        if with_block_max:
            return v[:self.numel], self.block.block_max[:self.numel // 32]
        return v[:self.numel]

    def sent(self, indices):
        """``indices`` left (sparse path); masked as the setting says (True or False)."""
        indices = torch.as_tensor(indices, dtype=torch.long)
        self.memory.sent(self.block, indices, indices if self.masking else None)

    def sent_all(self):
        self.memory.sent_range(self.block, 0, self.numel)

    @property
    def u(self):
        u = self.memory.velocity("w")
        return torch.zeros(self.numel) if u is None else u

    @property
    def v(self):
        return self.memory.residual("w")


class Tensors:
    """``FlatMemory`` holding several tensors in one block, packed, as a launch holds the
    tensors going dense or through a compressor's own collectives."""

    def __init__(self, numels, momentum=0.0, device="cpu"):
        self.memory = FlatMemory()
        self.block = self.memory.block(tuple(range(len(numels))), tuple(numels), 0,
                                       device=device)
        self.momentum = momentum
        self.g = torch.zeros(self.block.total, device=device)

    def accumulate(self, grads):
        """Each tensor's ``v`` (flat views of the block) after folding ``grads`` in."""
        for i, g in enumerate(grads):
            lo, hi = self.block.span(i)
            self.g[lo:hi] = g.reshape(-1)
        self.memory.accumulate(self.block, self.g, [Run(0, self.block.total, self.momentum,
                                                        False)])
        return [self.block.slice_of(self.block.v, i) for i in range(len(grads))]

    def sent_all(self, i):
        self.memory.sent_range(self.block, *self.block.span(i))

    def residual(self, i):
        return self.memory.residual(i)
