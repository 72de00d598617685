"""ResNets cut into pipeline stages, with an auxiliary head on every cut, built from spec strings.

The networks of interlocking backpropagation (arXiv 2010.04116), described the way its authors'
code describes them: a block type, an architecture string, how many blocks each component (each
pipeline stage) takes, and an auxiliary head spec. The stem counts as the first block and the
output layers (average pool, flatten, Linear) as the last::

    resnet("basic", "64,3/128,4/256,6/512,3", "conv128_bn_conv64_bn_gbpl_fc", "1,1,1,rest", 10)

          x [N, C, H, W]
          |
    +-----v---------------------+
    | stem: conv-bn-relu        |  component 0 ("1")  ---> head 0: conv128-bn-relu-conv64-bn-relu
    +-----+---------------------+                                  -avgpool-flatten-fc -> scores
          |
    +-----v---------------------+
    | block 64                  |  component 1 ("1")  ---> head 1 (the same spec, on 64 channels)
    +-----+---------------------+
          |
    +-----v---------------------+
    | block 64                  |  component 2 ("1")  ---> head 2
    +-----+---------------------+
          |
    +-----v---------------------+
    | block 64, block 128 x 4,  |  component 3 ("rest"): every block left, then the output
    | 256 x 6, 512 x 3, avgpool |  layers; it has the real loss and no head
    | flatten, Linear           |
    +-----+---------------------+
          v
      class scores

:func:`resnet` returns ``(stages, heads)``: one ``nn.Sequential`` per component and one head per
component but the last, for ``PipelineRunner(stages, ..., aux_heads=heads)`` with an interlocking
schedule. :func:`stages` and :func:`heads` take the same (keyword) arguments and return one half
each, so that a job file can name them (the runner builds both under the job's seed, so the two
calls build the same network)::

    stages = "pipeq.models.resnet:stages"
    aux_heads = "pipeq.models.resnet:heads"
    # ... the job's other keys, then its tables (TOML's inline tables take one line each)
    [stages_args]
    block = "basic"
    architecture = "16,1/32,1/64,1"
    head = "conv32_bn_gbpl_fc"
    blocks_per_component = "1,1,1,rest"
    n_classes = 10
    in_channels = 1
    stem_channels = 16
    [aux_heads_args]
    # ... the same keys and values as [stages_args]

Head specs (:func:`aux_head`) are tokens joined by ``_``, read left to right:

- ``conv<ch>``: a 3x3 convolution to ``ch`` channels (padding 1), then ReLU;
- ``bn``: BatchNorm2d, right after a ``conv<ch>``: it goes between that conv and its ReLU;
- ``gbpl``: global average pooling, then flatten (feature maps -> one vector per sample);
- ``fc<width>`` (pipeq's addition, after ``gbpl``): a hidden Linear to ``width`` features + ReLU;
- ``fc`` (after ``gbpl``, last): the Linear to ``n_classes`` class scores that ends every head.

So ``"gbpl_fc"`` is a linear probe of the pooled features and ``"conv32_bn_gbpl_fc"`` is
conv3x3(32)-BN-ReLU-avgpool-flatten-Linear. There is no ``flt`` (flatten without pooling): the
authors' code does not support it either. The blocks are the standard ResNet v1.5 ones (no
torchvision needed): basic = conv3x3-BN-ReLU-conv3x3-BN plus the shortcut, ReLU; bottleneck =
conv1x1-BN-ReLU-conv3x3(stride)-BN-ReLU-conv1x1(4x)-BN plus the shortcut, ReLU; the shortcut is
conv1x1(stride)-BN when the stride or the channels change. Convolutions start Kaiming-normal
(fan_out, ReLU), BatchNorm at weight 1 and bias 0, as in the authors' code. Nothing here checks
an input size: the CIFAR stem runs on 8x8 digits (``in_channels=1``) as well as on 32x32 images.
"""

from __future__ import annotations

import re
from typing import Sequence

import torch
from torch import nn

__all__ = ["HEAD_GRAMMAR", "STEMS", "ARCHITECTURE_EXAMPLE", "BLOCKS", "BasicBlock", "Bottleneck", "parse_head",
           "aux_head", "parse_architecture", "parse_components", "resnet", "stages", "heads"]

#: The head spec grammar, as the errors state it.
HEAD_GRAMMAR = ("tokens joined by '_': conv<ch> (3x3 conv + ReLU), bn (BatchNorm2d, right after a conv), "
                "gbpl (global average pool + flatten), fc<width> (hidden Linear + ReLU, after gbpl), "
                "fc (Linear to the class scores, after gbpl, last); e.g. 'conv32_bn_gbpl_fc' or 'gbpl_fc'")
STEMS = ("cifar", "imagenet")
ARCHITECTURE_EXAMPLE = "'64,3/128,4/256,6/512,3' (planes,blocks of each superblock)"


class BasicBlock(nn.Module):
    """conv3x3(stride)-BN-ReLU-conv3x3-BN, plus the shortcut, then ReLU (ResNet-18/34)."""

    expansion = 1

    def __init__(self, in_channels: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        out = planes * self.expansion
        self.conv1 = nn.Conv2d(in_channels, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out)
        self.downsample = _shortcut(in_channels, out, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return torch.relu(y + (x if self.downsample is None else self.downsample(x)))


class Bottleneck(nn.Module):
    """conv1x1-BN-ReLU-conv3x3(stride)-BN-ReLU-conv1x1(4 x planes)-BN, plus the shortcut, then
    ReLU: the stride on the 3x3 convolution (v1.5, ResNet-50/101/152)."""

    expansion = 4

    def __init__(self, in_channels: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        out = planes * self.expansion
        self.conv1 = nn.Conv2d(in_channels, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.downsample = _shortcut(in_channels, out, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        y = torch.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return torch.relu(y + (x if self.downsample is None else self.downsample(x)))


BLOCKS: dict[str, type[BasicBlock] | type[Bottleneck]] = {"basic": BasicBlock, "bottleneck": Bottleneck}


def _shortcut(in_channels: int, out_channels: int, stride: int) -> nn.Sequential | None:
    """conv1x1(stride)-BN when the block changes the shape; None (the identity) otherwise."""
    if stride == 1 and in_channels == out_channels:
        return None
    return nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                         nn.BatchNorm2d(out_channels))


# -- auxiliary heads ---------------------------------------------------------------------------


def _size(token: str, prefix: str, spec: str) -> int | None:
    """The number after ``prefix`` in ``token`` (None: the token is not ``prefix<n>``)."""
    m = re.fullmatch(re.escape(prefix) + r"(\d+)", token)
    if m is None:
        return None
    n = int(m.group(1))
    if n < 1:
        raise ValueError(f"head spec {spec!r}: {token!r} makes {n} features; give a positive size, "
                         f"e.g. {prefix}32")
    return n


def parse_head(spec: str) -> list[tuple[str, int]]:
    """The layers of head spec ``spec``, checked: ``("conv", ch)``, ``("bn", 0)``, ``("gbpl", 0)``,
    ``("fc", width)`` (hidden) and ``("fc", 0)`` (the class scores, last)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"head spec {spec!r} is empty; a head spec is {HEAD_GRAMMAR}")
    tokens = spec.split("_")
    plan: list[tuple[str, int]] = []
    pooled = False
    for i, token in enumerate(tokens):
        if token == "":
            raise ValueError(f"head spec {spec!r} has an empty token (a '_' doubled, or at an end); "
                             f"a head spec is {HEAD_GRAMMAR}")
        if token == "flt":
            raise ValueError(f"head spec {spec!r}: flt (flatten without pooling) is not supported (the "
                             "interlocking-backprop code this grammar comes from does not support it either): "
                             "use gbpl, global average pooling, before fc")
        conv, fc = _size(token, "conv", spec), _size(token, "fc", spec)
        if conv is not None:
            if pooled:
                raise ValueError(f"head spec {spec!r}: {token} comes after gbpl, where the feature maps are "
                                 "pooled to one vector already: put every conv<ch> before gbpl")
            plan.append(("conv", conv))
        elif token == "bn":
            if pooled:
                raise ValueError(f"head spec {spec!r}: bn comes after gbpl; bn normalizes the feature maps of "
                                 "the conv<ch> right before it (BatchNorm2d): put it there, before gbpl")
            if not plan or plan[-1][0] != "conv":
                where = f"after {tokens[i - 1]!r}" if i else "first"
                raise ValueError(f"head spec {spec!r}: bn comes {where}; bn normalizes the output of the "
                                 "conv<ch> right before it, ahead of that conv's ReLU (e.g. 'conv32_bn_gbpl_fc')")
            plan.append(("bn", 0))
        elif token == "gbpl":
            if pooled:
                raise ValueError(f"head spec {spec!r} pools twice: keep one gbpl")
            plan.append(("gbpl", 0))
            pooled = True
        elif token == "fc" or fc is not None:
            if not pooled:
                fixed = "_".join(tokens[:i] + ["gbpl"] + [t for t in tokens[i:] if t != "gbpl"])
                raise ValueError(f"head spec {spec!r}: {token} comes before gbpl; a Linear layer reads one "
                                 f"vector per sample: pool first, e.g. {fixed!r}")
            if token == "fc" and i != len(tokens) - 1:
                raise ValueError(f"head spec {spec!r}: fc gives the class scores and ends the head, but "
                                 f"{'_'.join(tokens[i + 1:])!r} follows it; a hidden layer is fc<width> "
                                 "(e.g. 'gbpl_fc64_fc')")
            plan.append(("fc", fc or 0))
        else:
            raise ValueError(f"head spec {spec!r}: unknown token {token!r}; a head spec is {HEAD_GRAMMAR}")
    if tokens[-1] != "fc":
        raise ValueError(f"head spec {spec!r} does not end in fc: a head must end in the class scores its "
                         f"loss is computed on, e.g. {spec + ('_fc' if pooled else '_gbpl_fc')!r}")
    return plan


def aux_head(spec: str, in_channels: int, n_classes: int) -> nn.Sequential:
    """The auxiliary head ``spec`` describes, reading ``in_channels`` feature maps and giving
    ``n_classes`` class scores (see the module docstring for the grammar)."""
    plan = parse_head(spec)
    for name, value in (("in_channels", in_channels), ("n_classes", n_classes)):
        if type(value) is not int or value < 1:
            raise ValueError(f"aux_head: {name} = {value!r}; give a positive integer")
    layers: list[nn.Module] = []
    width = in_channels  # channels of the feature maps, then features of the pooled vector
    for kind, size in plan:
        if kind == "conv":
            layers += [nn.Conv2d(width, size, 3, padding=1), nn.ReLU()]
            width = size
        elif kind == "bn":  # between the conv before it and that conv's ReLU
            layers.insert(len(layers) - 1, nn.BatchNorm2d(width))
        elif kind == "gbpl":
            layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        elif size:  # a hidden fc<width>
            layers += [nn.Linear(width, size), nn.ReLU()]
            width = size
        else:
            layers.append(nn.Linear(width, n_classes))
    return nn.Sequential(*layers)


# -- the network --------------------------------------------------------------------------------


def parse_architecture(architecture: str) -> list[tuple[int, int]]:
    """``"64,3/128,4"`` -> ``[(64, 3), (128, 4)]``: (planes, blocks) of each superblock."""
    if not isinstance(architecture, str) or not architecture.strip():
        raise ValueError(f"architecture = {architecture!r}: expected planes,blocks per superblock, joined by '/', "
                         f"e.g. {ARCHITECTURE_EXAMPLE}")
    out = []
    for i, part in enumerate(architecture.split("/")):
        fields = part.split(",")
        try:
            planes, blocks = (int(f) for f in fields) if len(fields) == 2 else (None, None)
        except ValueError:
            planes = blocks = None
        if planes is None or blocks is None:
            raise ValueError(f"architecture = {architecture!r}: superblock {i + 1} is {part!r}, not planes,blocks "
                             f"(two integers); e.g. {ARCHITECTURE_EXAMPLE}")
        if planes < 1 or blocks < 1:
            raise ValueError(f"architecture = {architecture!r}: superblock {i + 1} ({part!r}) needs at least 1 plane "
                             "and 1 block")
        out.append((planes, blocks))
    return out


def parse_components(blocks_per_component: Sequence[str | int] | str) -> list[int | None]:
    """``"1,2,rest"`` or ``["1", "2", "rest"]`` -> ``[1, 2, None]`` (None: the blocks left)."""
    setting = f"blocks_per_component = {blocks_per_component!r}"
    items = blocks_per_component.split(",") if isinstance(blocks_per_component, str) else blocks_per_component
    if not isinstance(items, (list, tuple)) or not items:
        raise ValueError(f"{setting}: expected block counts per component ending in 'rest', e.g. '1,1,1,rest' or "
                         "['1', '1', '1', 'rest']")
    out: list[int | None] = []
    for i, item in enumerate(items):
        item = item.strip() if isinstance(item, str) else item
        if item == "rest":
            if i != len(items) - 1:
                raise ValueError(f"{setting}: 'rest' must end the list (the last component takes the blocks the "
                                 "others leave), e.g. '1,1,1,rest'")
            out.append(None)
            continue
        if isinstance(item, bool) or not (isinstance(item, int) or isinstance(item, str) and item.isdigit()):
            raise ValueError(f"{setting}: component {i} is {item!r}, neither a block count nor 'rest'")
        if int(item) < 1:
            raise ValueError(f"{setting}: component {i} has {int(item)} blocks; every component needs at least 1")
        out.append(int(item))
    if out[-1] is not None:
        fixed = ",".join([str(n) for n in out[:-1]] + ["rest"])
        raise ValueError(f"{setting}: 'rest' must end the list (the last component takes the blocks the others "
                         f"leave), e.g. {fixed!r}")
    return out


def _stem(kind: str, in_channels: int, channels: int) -> nn.Sequential:
    if kind == "cifar":  # small images: keep the resolution
        return nn.Sequential(nn.Conv2d(in_channels, channels, 3, padding=1, bias=False),
                             nn.BatchNorm2d(channels), nn.ReLU())
    return nn.Sequential(nn.Conv2d(in_channels, channels, 7, stride=2, padding=3, bias=False),  # imagenet: 1/4
                         nn.BatchNorm2d(channels), nn.ReLU(), nn.MaxPool2d(3, stride=2, padding=1))


def resnet(block: str, architecture: str, head: str, blocks_per_component: Sequence[str | int] | str,
           n_classes: int, stem: str = "cifar", in_channels: int = 3,
           stem_channels: int = 64) -> tuple[list[nn.Module], list[nn.Module]]:
    """A ResNet cut into components: ``(stages, heads)``, one ``nn.Sequential`` per component and
    one auxiliary head (built by :func:`aux_head` from ``head``) per component but the last.

    ``block``: "basic" or "bottleneck"; ``architecture``: planes,blocks per superblock joined by
    "/" (the first superblock keeps the resolution, each later one halves it); ``blocks_per_component``:
    block counts ending in "rest" (a list, or one string "1,2,rest"), where the stem is the first
    block and the output layers the last; ``stem``: "cifar" (3x3 conv) or "imagenet" (7x7 conv,
    stride 2, then a 3x3 max pool, stride 2). Under one seed the stages' weights do not depend on
    the head spec or on where the network is cut: schemes with other heads start from the same
    network.
    """
    if block not in BLOCKS:
        raise ValueError(f"block = {block!r}: choose 'basic' (ResNet-18/34) or 'bottleneck' (ResNet-50/101/152)")
    if stem not in STEMS:
        raise ValueError(f"stem = {stem!r}: choose 'cifar' (3x3 conv, for small images such as CIFAR's or "
                         "digits') or 'imagenet' (7x7 conv, stride 2, and a max pool)")
    for name, value in (("n_classes", n_classes), ("in_channels", in_channels), ("stem_channels", stem_channels)):
        if type(value) is not int or value < 1:
            raise ValueError(f"{name} = {value!r}: give a positive integer")
    superblocks = parse_architecture(architecture)
    counts = parse_components(blocks_per_component)
    parse_head(head)  # a bad spec fails here, before anything is built

    kind = BLOCKS[block]
    layers: list[tuple[nn.Module, int]] = [(_stem(stem, in_channels, stem_channels), stem_channels)]
    for s, (planes, n) in enumerate(superblocks):
        for b in range(n):
            c_in = layers[-1][1]
            layers.append((kind(c_in, planes, stride=2 if s > 0 and b == 0 else 1), planes * kind.expansion))
    layers.append((nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(layers[-1][1], n_classes)),
                   n_classes))

    n_blocks = len(layers)
    setting = f"blocks_per_component = {blocks_per_component!r}"
    what = (f"the stem, {n_blocks - 2} residual block{'s' if n_blocks != 3 else ''} of architecture = "
            f"{architecture!r}, the output layers")
    if len(counts) > n_blocks:
        raise ValueError(f"{setting}: {len(counts)} components, but the network has {n_blocks} blocks ({what}): "
                         "give at most one component per block")
    fixed = sum(c for c in counts if c is not None)
    if fixed >= n_blocks:
        raise ValueError(f"{setting}: the components before 'rest' take {fixed} blocks, but the network has "
                         f"{n_blocks} ({what}), and 'rest' needs at least 1: take fewer blocks before 'rest'")

    for module, _ in layers:  # before any head is built: the same network whatever the heads
        _init(module)
    stages: list[nn.Module] = []
    heads: list[nn.Module] = []
    start = 0
    for i, count in enumerate(counts):
        end = n_blocks if count is None else start + count
        part = layers[start:end]
        stages.append(nn.Sequential(*(m for m, _ in part)))
        if i < len(counts) - 1:
            heads.append(_init(aux_head(head, part[-1][1], n_classes)))
        start = end
    return stages, heads


def _init(module: nn.Module) -> nn.Module:
    """Kaiming-normal convolutions (fan_out, ReLU), BatchNorm at weight 1 and bias 0."""
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
    return module


def stages(*, block: str, architecture: str, head: str, blocks_per_component: Sequence[str | int] | str,
           n_classes: int, stem: str = "cifar", in_channels: int = 3, stem_channels: int = 64) -> list[nn.Module]:
    """The stages of :func:`resnet` with these arguments (a job file's ``stages``)."""
    return resnet(block, architecture, head, blocks_per_component, n_classes, stem, in_channels, stem_channels)[0]


def heads(*, block: str, architecture: str, head: str, blocks_per_component: Sequence[str | int] | str,
          n_classes: int, stem: str = "cifar", in_channels: int = 3, stem_channels: int = 64) -> list[nn.Module]:
    """The auxiliary heads of :func:`resnet` with these arguments (a job file's ``aux_heads``).
    It builds the whole network, as :func:`stages` does: under the same seed both calls make the
    same one, so these heads belong to those stages."""
    return resnet(block, architecture, head, blocks_per_component, n_classes, stem, in_channels, stem_channels)[1]
