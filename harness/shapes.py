"""ResNet-50's parameter shapes (torchvision's layout), built from the architecture so the
benchmarks need no torchvision: 161 tensors, 25,557,032 parameters; and the stdlib byte
LM's (harness/stdlib_lm.py, bench/adam_lm.py)."""


def resnet50_shapes(num_classes=1000):
    shapes = [("conv1.weight", (64, 3, 7, 7)), ("bn1.weight", (64,)), ("bn1.bias", (64,))]
    inplanes = 64
    for layer, (planes, blocks) in enumerate([(64, 3), (128, 4), (256, 6), (512, 3)], start=1):
        for b in range(blocks):
            pre = f"layer{layer}.{b}"
            shapes += [(f"{pre}.conv1.weight", (planes, inplanes, 1, 1)),
                       (f"{pre}.bn1.weight", (planes,)), (f"{pre}.bn1.bias", (planes,)),
                       (f"{pre}.conv2.weight", (planes, planes, 3, 3)),
                       (f"{pre}.bn2.weight", (planes,)), (f"{pre}.bn2.bias", (planes,)),
                       (f"{pre}.conv3.weight", (planes * 4, planes, 1, 1)),
                       (f"{pre}.bn3.weight", (planes * 4,)), (f"{pre}.bn3.bias", (planes * 4,))]
            if b == 0:
                shapes += [(f"{pre}.downsample.0.weight", (planes * 4, inplanes, 1, 1)),
                           (f"{pre}.downsample.1.weight", (planes * 4,)),
                           (f"{pre}.downsample.1.bias", (planes * 4,))]
            inplanes = planes * 4
    shapes += [("fc.weight", (num_classes, 2048)), ("fc.bias", (num_classes,))]
    return shapes


def lm_shapes():
    """The stdlib byte LM's parameter shapes (harness/stdlib_lm.py ``byte_lm``)."""
    from harness.stdlib_lm import byte_lm
    return [(name, tuple(p.shape)) for name, p in byte_lm().named_parameters()]


def numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


if __name__ == "__main__":
    s = resnet50_shapes()
    print(len(s), sum(numel(x) for _, x in s))
