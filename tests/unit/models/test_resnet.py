"""pipeq.models.resnet: ResNets cut into components with auxiliary heads, from spec strings (one process,
no stage processes: the whole file takes a few seconds)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from pipeq.models import resnet as R
from pipeq.launch.job import load_job

ResNet34 = dict(block="basic", architecture="64,3/128,4/256,6/512,3", head="conv128_bn_conv64_bn_gbpl_fc",
                blocks_per_component="1,1,1,rest", n_classes=10)
DIGITS = dict(block="basic", architecture="16,1/32,1/64,1", head="conv32_bn_gbpl_fc",
              blocks_per_component="1,1,1,rest", n_classes=10, in_channels=1, stem_channels=16)


def types(module: nn.Module) -> list[type]:
    return [type(m) for m in module.children()]


def n_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# -- heads ------------------------------------------------------------------------------------


def test_head_conv128_bn_conv64_bn_gbpl_fc() -> None:
    """The authors' CIFAR head, on the 64 channels of a ResNet-34's first components."""
    head = R.aux_head("conv128_bn_conv64_bn_gbpl_fc", 64, 10)
    assert types(head) == [nn.Conv2d, nn.BatchNorm2d, nn.ReLU, nn.Conv2d, nn.BatchNorm2d, nn.ReLU,
                           nn.AdaptiveAvgPool2d, nn.Flatten, nn.Linear]
    assert head(torch.randn(4, 64, 32, 32)).shape == (4, 10)
    # conv128 on 64 channels: 64*128*9 weights + 128 biases = 73728 + 128 = 73856
    # bn over 128: weight + bias = 2*128 = 256
    # conv64 on 128 channels: 128*64*9 + 64 = 73728 + 64 = 73792
    # bn over 64: 2*64 = 128
    # fc 64 -> 10: 64*10 + 10 = 650
    assert n_params(head) == 73856 + 256 + 73792 + 128 + 650 == 148682


def test_head_conv32_bn_gbpl_fc() -> None:
    head = R.aux_head("conv32_bn_gbpl_fc", 3, 10)
    assert types(head) == [nn.Conv2d, nn.BatchNorm2d, nn.ReLU, nn.AdaptiveAvgPool2d, nn.Flatten, nn.Linear]
    assert head(torch.randn(20, 3, 16, 16)).shape == (20, 10)
    # conv32 on 3 channels: 3*32*9 + 32 = 864 + 32 = 896; bn over 32: 2*32 = 64; fc 32 -> 10: 32*10 + 10 = 330
    assert n_params(head) == 896 + 64 + 330 == 1290


def test_heads_gbpl_fc_and_conv32_gbpl_fc() -> None:
    head = R.aux_head("gbpl_fc", 3, 10)
    assert types(head) == [nn.AdaptiveAvgPool2d, nn.Flatten, nn.Linear]
    assert head(torch.randn(10, 3, 16, 16)).shape == (10, 10)
    head = R.aux_head("conv32_gbpl_fc", 3, 7)
    assert types(head) == [nn.Conv2d, nn.ReLU, nn.AdaptiveAvgPool2d, nn.Flatten, nn.Linear]
    assert head(torch.randn(20, 3, 16, 16)).shape == (20, 7)
    assert head[0].padding == (1, 1) and head[0].kernel_size == (3, 3)


def test_head_hidden_fc_width_is_pipeqs_addition() -> None:
    head = R.aux_head("gbpl_fc64_fc", 16, 10)
    assert types(head) == [nn.AdaptiveAvgPool2d, nn.Flatten, nn.Linear, nn.ReLU, nn.Linear]
    assert (head[2].in_features, head[2].out_features, head[4].in_features) == (16, 64, 64)
    assert head(torch.randn(3, 16, 5, 5)).shape == (3, 10)


@pytest.mark.parametrize("spec, message", [
    ("conv32_pool_fc", "unknown token 'pool'; a head spec is tokens joined by '_': conv<ch>"),
    ("conv32_fc", "fc comes before gbpl; a Linear layer reads one vector per sample: pool first, e.g. "
                  "'conv32_gbpl_fc'"),
    ("fc64_gbpl_fc", "fc64 comes before gbpl"),
    ("gbpl_conv32_fc", "conv32 comes after gbpl, where the feature maps are pooled to one vector already"),
    ("", "head spec '' is empty; a head spec is tokens joined by '_'"),
    ("conv32__gbpl_fc", "has an empty token"),
    ("flt_fc", "flt (flatten without pooling) is not supported (the interlocking-backprop code this grammar "
               "comes from does not support it either): use gbpl"),
    ("conv32_gbpl", "does not end in fc: a head must end in the class scores its loss is computed on, e.g. "
                    "'conv32_gbpl_fc'"),
    ("conv32", "does not end in fc: a head must end in the class scores its loss is computed on, e.g. "
               "'conv32_gbpl_fc'"),
    ("gbpl_fc64", "does not end in fc"),
    ("gbpl_fc_fc64", "fc gives the class scores and ends the head, but 'fc64' follows it"),
    ("bn_conv32_gbpl_fc", "bn comes first; bn normalizes the output of the conv<ch> right before it"),
    ("conv32_bn_bn_gbpl_fc", "bn comes after 'bn'"),
    ("conv32_gbpl_bn_fc", "bn comes after gbpl"),
    ("gbpl_gbpl_fc", "pools twice"),
    ("conv0_gbpl_fc", "'conv0' makes 0 features; give a positive size"),
])
def test_head_spec_errors(spec: str, message: str) -> None:
    with pytest.raises(ValueError) as err:
        R.aux_head(spec, 16, 10)
    assert message in str(err.value)


# -- networks ---------------------------------------------------------------------------------


def test_resnet34_like_in_four_components() -> None:
    torch.manual_seed(0)
    stages, heads = R.resnet(**ResNet34)
    assert len(stages) == 4 and len(heads) == len(stages) - 1
    # the stem, one block, one block, then 1 + 4 + 6 + 3 blocks and the output layers
    assert [len(s) for s in stages] == [1, 1, 1, 15]
    assert isinstance(stages[0][0][0], nn.Conv2d) and stages[0][0][0].kernel_size == (3, 3)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        for k, stage in enumerate(stages):
            x = stage(x)
            if k < 3:
                assert x.shape == (2, 64, 32, 32)
                assert heads[k](x).shape == (2, 10)
    assert x.shape == (2, 10)
    # the CIFAR stem is 3x3: the 7x7 of torchvision's resnet34 has 64*3*(49 - 9) = 7680 more weights
    # than ours, which otherwise has its 21,289,802 parameters (10 classes)
    assert sum(n_params(s) for s in stages) == 21289802 - 7680
    # initialisation: Kaiming normal (fan_out, relu); BatchNorm 1 and 0
    conv = stages[3][-2].conv2  # 512 -> 512, 3x3: fan_out 512*9
    assert conv.weight.std().item() == pytest.approx(math.sqrt(2 / (512 * 9)), rel=0.02)
    bns = [m for s in stages + heads for m in s.modules() if isinstance(m, nn.BatchNorm2d)]
    assert all(bool((b.weight == 1).all()) and bool((b.bias == 0).all()) for b in bns)


def test_bottleneck_blocks() -> None:
    torch.manual_seed(0)
    stages, heads = R.resnet("bottleneck", "8,2/16,2", "gbpl_fc", ["1", "2", "rest"], 5, stem_channels=16)
    first, second = stages[1]
    assert isinstance(first, R.Bottleneck)
    # 1x1 to the planes, 3x3, 1x1 to 4 x planes; a shortcut where the channels change (16 -> 32)
    assert [first.conv1.kernel_size, first.conv2.kernel_size, first.conv3.kernel_size] == [(1, 1), (3, 3), (1, 1)]
    assert (first.conv1.out_channels, first.conv3.out_channels) == (8, 32)
    assert first.downsample is not None and second.downsample is None
    down = stages[2][0]  # the first block of the second superblock: stride 2 on its 3x3 (v1.5)
    assert (down.conv1.stride, down.conv2.stride, down.downsample[0].stride) == ((1, 1), (2, 2), (2, 2))
    assert [h[-1].in_features for h in heads] == [16, 32]
    x = torch.randn(2, 3, 16, 16)
    shapes = []
    for stage in stages:
        x = stage(x)
        shapes.append(tuple(x.shape))
    assert shapes == [(2, 16, 16, 16), (2, 32, 16, 16), (2, 5)]


def test_imagenet_stem_shapes() -> None:
    stages, heads = R.resnet("basic", "8,1/16,1/32,1", "gbpl_fc", "1,1,1,rest", 10, stem="imagenet",
                             stem_channels=8)
    stem = stages[0][0]
    assert types(stem) == [nn.Conv2d, nn.BatchNorm2d, nn.ReLU, nn.MaxPool2d]
    assert (stem[0].kernel_size, stem[0].stride) == ((7, 7), (2, 2))
    x = torch.randn(2, 3, 64, 64)
    assert stem[:3](x).shape == (2, 8, 32, 32)  # the 7x7 conv halves 64
    shapes = []
    for stage in stages:
        x = stage(x)
        shapes.append(tuple(x.shape))
    # the max pool halves again; the second superblock halves once more
    assert shapes == [(2, 8, 16, 16), (2, 8, 16, 16), (2, 16, 8, 8), (2, 10)]


def test_digits_sized_input() -> None:
    """1-channel 8x8 images: no input shape is asserted anywhere."""
    stages, heads = R.resnet(**DIGITS)
    x = torch.randn(5, 1, 8, 8)
    shapes = []
    for k, stage in enumerate(stages):
        x = stage(x)
        shapes.append(tuple(x.shape))
        if k < 3:
            assert heads[k](x).shape == (5, 10)
    assert shapes == [(5, 16, 8, 8), (5, 16, 8, 8), (5, 32, 4, 4), (5, 10)]
    imagenet = R.resnet(**{**DIGITS, "stem": "imagenet"})[0]
    assert imagenet[0](torch.randn(5, 1, 8, 8)).shape == (5, 16, 2, 2)


def test_blocks_per_component_forms_and_a_single_component() -> None:
    a = R.resnet(**{**DIGITS, "blocks_per_component": ["2", "1", "rest"]})
    b = R.resnet(**{**DIGITS, "blocks_per_component": [2, 1, "rest"]})
    assert [len(s) for s in a[0]] == [len(s) for s in b[0]] == [2, 1, 2]
    stages, heads = R.resnet(**{**DIGITS, "blocks_per_component": "rest"})
    assert len(stages) == 1 and heads == []
    assert stages[0](torch.randn(2, 1, 8, 8)).shape == (2, 10)


@pytest.mark.parametrize("change, message", [
    ({"blocks_per_component": "1,rest,1"}, "blocks_per_component = '1,rest,1': 'rest' must end the list"),
    ({"blocks_per_component": ["1", "2"]}, "blocks_per_component = ['1', '2']: 'rest' must end the list"),
    ({"blocks_per_component": "1,0,rest"}, "blocks_per_component = '1,0,rest': component 1 has 0 blocks; "
                                           "every component needs at least 1"),
    ({"blocks_per_component": "1,x,rest"}, "component 1 is 'x', neither a block count nor 'rest'"),
    ({"blocks_per_component": []}, "blocks_per_component = []: expected block counts per component"),
    ({"architecture": "16,1", "blocks_per_component": "1,1,1,rest"},
     "blocks_per_component = '1,1,1,rest': 4 components, but the network has 3 blocks (the stem, 1 residual "
     "block of architecture = '16,1', the output layers)"),
    ({"blocks_per_component": "2,3,rest"}, "the components before 'rest' take 5 blocks, but the network has 5"),
    ({"block": "resnet"}, "block = 'resnet': choose 'basic' (ResNet-18/34) or 'bottleneck'"),
    ({"architecture": "64,3/128"}, "architecture = '64,3/128': superblock 2 is '128', not planes,blocks"),
    ({"architecture": "64;3"}, "architecture = '64;3': superblock 1 is '64;3', not planes,blocks"),
    ({"architecture": ""}, "architecture = '': expected planes,blocks per superblock, joined by '/'"),
    ({"architecture": "64,0"}, "architecture = '64,0': superblock 1 ('64,0') needs at least 1 plane and 1 block"),
    ({"stem": "mnist"}, "stem = 'mnist': choose 'cifar'"),
    ({"stem_channels": 0}, "stem_channels = 0: give a positive integer"),
    ({"head": "conv32_fc"}, "fc comes before gbpl"),
])
def test_network_errors(change: dict, message: str) -> None:
    with pytest.raises(ValueError) as err:
        R.resnet(**{**DIGITS, **change})
    assert message in str(err.value)


def test_stages_and_heads_are_resnets_halves() -> None:
    torch.manual_seed(7)
    stages, heads = R.resnet(**DIGITS)
    torch.manual_seed(7)
    only_stages = R.stages(**DIGITS)
    torch.manual_seed(7)
    only_heads = R.heads(**DIGITS)
    for a, b in zip(stages + heads, only_stages + only_heads, strict=True):
        assert _same(a, b)


def test_the_network_does_not_depend_on_the_heads_or_the_cut() -> None:
    torch.manual_seed(1)
    a, _ = R.resnet(**DIGITS)
    torch.manual_seed(1)
    b, _ = R.resnet(**{**DIGITS, "head": "conv64_bn_conv8_bn_gbpl_fc64_fc", "blocks_per_component": "2,rest"})
    assert [len(s) for s in b] == [2, 3]
    assert _same(nn.Sequential(*(m for s in a for m in s)), nn.Sequential(*(m for s in b for m in s)))


def _same(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# -- through a job file -----------------------------------------------------------------------


def _job(tmp_path, seed: int = 3, args: str = "") -> str:
    table = ('{ block = "basic", architecture = "8,1/16,1", head = "conv8_bn_gbpl_fc", '
             'blocks_per_component = "1,1,rest", n_classes = 10, in_channels = 1, stem_channels = 8' + args + " }")
    path = tmp_path / f"resnet{seed}.toml"
    path.write_text(f"""
stages = "pipeq.models.resnet:stages"
stages_args = {table}
aux_heads = "pipeq.models.resnet:heads"
aux_heads_args = {table}
loss = "torch.nn:CrossEntropyLoss"
optimizer = "torch.optim:SGD"
optimizer_args = {{ lr = 0.1 }}
data = "examples.digits_job:train_batches"
schedule = "pairwise"
microbatches = 2
steps = 1
seed = {seed}
""")
    return str(path)


def test_a_job_file_builds_the_same_stages_and_heads_twice(tmp_path) -> None:
    recipe = load_job(_job(tmp_path)).recipe
    n = recipe.count_stages()
    assert n == 3
    first = [recipe.build(k, n) for k in range(n)]
    second = [recipe.build(k, n) for k in range(n)]
    for a, b in zip(first, second):
        assert _same(a.module, b.module)
        assert (a.aux_head is None) == (b.aux_head is None) and (a.aux_head is None or _same(a.aux_head, b.aux_head))
    assert first[2].aux_head is None and first[0].aux_head is not None
    # they are the network resnet() builds under the job's seed: these heads belong to these stages
    torch.manual_seed(3)
    stages, heads = R.resnet("basic", "8,1/16,1", "conv8_bn_gbpl_fc", "1,1,rest", 10, in_channels=1, stem_channels=8)
    for k in range(n):
        assert _same(first[k].module, stages[k])
    for k in range(n - 1):
        assert _same(first[k].aux_head, heads[k])
    x = torch.randn(4, 1, 8, 8)
    for k, spec in enumerate(first):
        x = spec.module(x)
        if spec.aux_head is not None:
            assert spec.aux_head(x).shape == (4, 10)
    assert x.shape == (4, 10)
    other = load_job(_job(tmp_path, seed=4)).recipe.build(0, n)
    assert not _same(other.module, first[0].module)


def test_a_job_files_misspelt_argument_is_named(tmp_path) -> None:
    recipe = load_job(_job(tmp_path, args=', stem_chanels = 4')).recipe
    with pytest.raises(ValueError, match=r"stages_args: stages = 'pipeq.models.resnet:stages' does not take the "
                                         r"argument\(s\) \['stem_chanels'\]; did you mean 'stem_channels'\?"):
        recipe.count_stages()
