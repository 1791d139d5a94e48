"""Synthetic training throughput, in the shape of Horovod's
examples/pytorch/pytorch_synthetic_benchmark.py, with DGC one flag away.

    horovodrun -np 2 -H localhost:2 python examples/pytorch_synthetic_benchmark.py
    horovodrun -np 2 -H localhost:2 python examples/pytorch_synthetic_benchmark.py --dgc

--model: any torchvision.models name (resnet50, the default, when torchvision
is installed), "wide_mlp" (built in: 33.5M parameters, about ResNet-50's 25.6M,
but little compute per byte of gradient, the case where the network dominates) or
"resnet18_builtin" (built in: torchvision's ResNet-18 layer for layer, 11.7M
parameters in 62 tensors, for machines without torchvision).
"""

import argparse
import importlib
import timeit

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

parser = argparse.ArgumentParser(description="PyTorch synthetic benchmark (Horovod / hvd_dgc)")
parser.add_argument("--model", default=None,
                    help="torchvision model name, wide_mlp or resnet18_builtin")
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--num-warmup-batches", type=int, default=10)
parser.add_argument("--num-batches-per-iter", type=int, default=10)
parser.add_argument("--num-iters", type=int, default=10)
parser.add_argument("--fp16-allreduce", action="store_true")
parser.add_argument("--no-cuda", action="store_true")
dgc = parser.add_argument_group("hvd_dgc")
dgc.add_argument("--dgc", action="store_true", help="Deep Gradient Compression (hvd_dgc)")
dgc.add_argument("--density", type=float, default=0.001)
dgc.add_argument("--delay", type=int, default=0, help="delayed gradient averaging steps")
dgc.add_argument("--assumed-link", action="store_true",
                 help="cost_model=hvd_dgc.CostModel(): a 1 Gbit/s link assumed, not measured "
                      "(by default the link and DGC's own work are timed at wrap time)")
args = parser.parse_args()

# The one-line switch: hvd_dgc.torch is horovod.torch plus DGC's optimizer and compressors.
hvd = importlib.import_module("hvd_dgc.torch" if args.dgc else "horovod.torch")


def wide_mlp():
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 4096), nn.ReLU(),
                         nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 1000))


class BasicBlock(nn.Module):
    def __init__(self, inputs, outputs, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(outputs)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(outputs)
        self.downsample = None
        if stride != 1 or inputs != outputs:
            self.downsample = nn.Sequential(nn.Conv2d(inputs, outputs, 1, stride, bias=False),
                                            nn.BatchNorm2d(outputs))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.downsample is None else self.downsample(x)))


def resnet18_builtin():
    """ResNet-18 (He et al. 2016) as torchvision builds it, without torchvision."""
    layers = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
              nn.MaxPool2d(3, 2, 1)]
    inputs = 64
    for outputs, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [BasicBlock(inputs, outputs, stride), BasicBlock(outputs, outputs, 1)]
        inputs = outputs
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 1000)]
    return nn.Sequential(*layers)


def build_model():
    """(model, input shape, description); says when torchvision is missing."""
    name = args.model
    if name == "resnet18_builtin":
        return resnet18_builtin(), (3, 224, 224), "resnet18_builtin (built in)"
    if name != "wide_mlp":
        try:
            from torchvision import models
            name = name or "resnet50"
            return getattr(models, name)(), (3, 224, 224), f"{name} (torchvision)"
        except ImportError:
            if name:
                raise SystemExit(f"--model {name} needs torchvision (pip install torchvision), "
                                 f"or use --model wide_mlp")
    return wide_mlp(), (3, 32, 32), ("wide_mlp (built in; torchvision not installed)"
                                     if args.model is None else "wide_mlp (built in)")


def main():
    hvd.init()
    cuda = not args.no_cuda and torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(hvd.local_rank())
    else:
        torch.set_num_threads(1)
    device = "cuda" if cuda else "cpu"
    model, shape, description = build_model()
    model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size(), momentum=0.9)
    # Horovod's line, unchanged: under hvd_dgc (--dgc) Compression.none / fp16 mean DGC
    # with fp32 / fp16 values; without --dgc this is Horovod itself, dense.
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    if args.dgc:
        options = dict(density=args.density, delay=args.delay)
        if args.assumed_link:
            options["cost_model"] = hvd.CostModel()
    else:
        options = {}
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression, **options)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    data = torch.randn(args.batch_size, *shape, device=device)
    target = torch.randint(0, 1000, (args.batch_size,), device=device)

    def benchmark_step():
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()

    def log(s):
        if hvd.rank() == 0:
            print(s, flush=True)

    unit = "GPU" if cuda else "CPU"
    params = sum(p.numel() for p in model.parameters())
    log(f"Model: {description}, {params / 1e6:.1f}M parameters; batch size {args.batch_size}; "
        f"{hvd.size()} {unit}s; {'hvd_dgc DGC density %g delay %d' % (args.density, args.delay) if args.dgc else 'Horovod dense'}"
        f"{' fp16' if args.fp16_allreduce else ''}")
    log("Running warmup...")
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)
    log("Running benchmark...")
    img_secs = []
    for x in range(args.num_iters):
        t = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / t
        log(f"Iter #{x}: {img_sec:.1f} img/sec per {unit}")
        img_secs.append(img_sec)
    if args.dgc and args.delay:
        optimizer.flush()
    mean, conf = np.mean(img_secs), 1.96 * np.std(img_secs)
    log(f"Img/sec per {unit}: {mean:.1f} +-{conf:.1f}")
    log(f"Total img/sec on {hvd.size()} {unit}(s): {hvd.size() * mean:.1f} +-{hvd.size() * conf:.1f}")
    if args.dgc:
        s = optimizer.compression_stats()
        log(f"Compression: sent {s['bytes_sent'] / 1e6:.2f} MB of {s['dense_fp32_bytes'] / 1e6:.2f} MB "
            f"dense fp32 ({s['compression_ratio']:.0f}x) over {s['steps']} steps")


if __name__ == "__main__":
    main()
