"""Maskable ResNet10 / ResNet18 (papers/000 "Network architectures"; docs/readings.md#network-architectures).

BasicBlocks ([1,1,1,1] for ResNet10, [2,2,2,2] for ResNet18; He et al. 2016), widths
64/128/256/512 scaled by ``width_mult``, a 3x3 stride-1 stem without max-pool (the
CIFAR-style variant the FedSAP/DapperFL code uses on 32x32 digits), BatchNorm, global
average pooling and one linear classifier.

Channel layers (see :mod:`fedsap_ray.models.space`):

- ``layer1`` .. ``layer4``: the residual streams. Identity shortcuts tie the stem
  (``conv1``/``bn1``) to every block output of stage 1, so the stem's channels ARE the
  ``layer1`` stream; for stages 2-4 the first block's shortcut conv+BN and every block's
  ``conv2``/``bn2`` produce the stream.
- ``layerS.B.conv1``: the inner (first) conv of each block, consumed only by ``conv2``.

The classifier's output units are never a channel layer. ``channels`` overrides the
count of any layer by name, which is how a physically sliced sub-model is built.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fedsap_ray.config.registry import register_model
from fedsap_ray.models.space import ChannelLayer, ChannelSpace, MaskableModel, ParamAxis, bn_out, conv_out, weight_in

BASE_WIDTHS = (64, 128, 256, 512)


def scaled(width: int, width_mult: float) -> int:
    """Channel count at a width multiplier: round, at least 1 (docs/readings.md#network-architectures)."""
    return max(1, int(round(width * width_mult)))


class BasicBlock(nn.Module):
    """Two 3x3 convs with BN; projection shortcut (1x1 conv + BN) only where the stream changes."""

    def __init__(self, in_planes: int, mid: int, planes: int, stride: int, projection: bool) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, mid, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(mid)
        self.conv2 = nn.Conv2d(mid, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = (nn.Sequential(nn.Conv2d(in_planes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))
                         if projection else nn.Sequential())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(MaskableModel):
    """CIFAR-style ResNet with BasicBlocks whose channels are described by a ChannelSpace."""

    input_dtype = torch.float32
    layer1: nn.Sequential  # the four streams, set with setattr in __init__
    layer2: nn.Sequential
    layer3: nn.Sequential
    layer4: nn.Sequential

    def __init__(self, num_blocks: Sequence[int], *, num_classes: int, input_shape: tuple[int, ...] = (3, 32, 32),
                 width_mult: float = 1.0, channels: Mapping[str, int] | None = None) -> None:
        super().__init__()
        if len(num_blocks) != 4:
            raise ValueError(f"ResNet: num_blocks must have 4 stages, got {tuple(num_blocks)}")
        if len(input_shape) != 3:
            raise ValueError(f"ResNet: input_shape must be (C, H, W), got {input_shape}")
        self.num_blocks = tuple(int(n) for n in num_blocks)
        self.input_shape = tuple(input_shape)
        counts: dict[str, int] = {}
        for s, base in enumerate(BASE_WIDTHS, start=1):
            counts[f"layer{s}"] = scaled(base, width_mult)
            for b in range(self.num_blocks[s - 1]):
                counts[f"layer{s}.{b}.conv1"] = counts[f"layer{s}"]
        if channels:
            unknown = set(channels) - set(counts)
            if unknown:
                raise ValueError(f"ResNet: unknown channel layers {sorted(unknown)}; layers are {list(counts)}")
            counts.update({k: int(v) for k, v in channels.items()})
        self._counts = counts

        self.conv1 = nn.Conv2d(input_shape[0], counts["layer1"], 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(counts["layer1"])
        in_stream = "layer1"
        for s in range(1, 5):
            blocks = []
            for b in range(self.num_blocks[s - 1]):
                stride = 2 if (s > 1 and b == 0) else 1
                stream = f"layer{s}"
                blocks.append(BasicBlock(counts[in_stream], counts[f"{stream}.{b}.conv1"], counts[stream], stride,
                                         projection=(stride != 1 or in_stream != stream)))
                in_stream = stream
            setattr(self, f"layer{s}", nn.Sequential(*blocks))
        self.feature_dim = counts["layer4"]
        self.fc = nn.Linear(self.feature_dim, num_classes)
        self.classifier = "fc"

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Encoder output (pooled features), used by representation losses (MOON, FedSR, FPL)."""
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer4(self.layer3(self.layer2(self.layer1(out))))
        return torch.flatten(F.adaptive_avg_pool2d(out, 1), 1)

    def conv_bn_pairs(self) -> list[tuple[str, str]]:
        """The stem, each block's two convs and each projection shortcut: every BN here reads one conv's output."""
        pairs = [("conv1", "bn1")]
        for s in range(1, 5):
            for b, block in enumerate(getattr(self, f"layer{s}")):
                p = f"layer{s}.{b}"
                pairs += [(f"{p}.conv1", f"{p}.bn1"), (f"{p}.conv2", f"{p}.bn2")]
                if len(block.shortcut):
                    pairs.append((f"{p}.shortcut.0", f"{p}.shortcut.1"))
        return pairs

    def activation_modules(self) -> dict[str, list[str]]:
        """Per channel layer, the submodules whose forward output carries its channels on dim 1.

        ``layerS.B.conv1`` -> its BatchNorm ``layerS.B.bn1`` (pre-ReLU); a stream ``layerS`` ->
        every block output ``layerS.B`` of the stage (after the residual add and ReLU), plus
        the stem's ``bn1`` (pre-ReLU) for ``layer1``, whose channels the stem produces.
        """
        out: dict[str, list[str]] = {}
        for s in range(1, 5):
            stream = f"layer{s}"
            out[stream] = (["bn1"] if s == 1 else []) + [f"{stream}.{b}" for b in range(self.num_blocks[s - 1])]
            for b in range(self.num_blocks[s - 1]):
                out[f"{stream}.{b}.conv1"] = [f"{stream}.{b}.bn1"]
        return out

    def channel_space(self) -> ChannelSpace:
        """Streams and inner convs in forward order (state_dict order of their first output tensor)."""
        layers: list[ChannelLayer] = []
        stream_out: dict[str, list[ParamAxis]] = {f"layer{s}": [] for s in range(1, 5)}
        stream_in: dict[str, list[ParamAxis]] = {f"layer{s}": [] for s in range(1, 5)}
        stream_out["layer1"] += [*conv_out("conv1", bias=False), *bn_out("bn1")]
        in_stream = "layer1"
        inner: list[tuple[str, ChannelLayer]] = []  # (stream it precedes, layer)
        for s in range(1, 5):
            stream = f"layer{s}"
            for b in range(self.num_blocks[s - 1]):
                p = f"{stream}.{b}"
                inner.append((stream, ChannelLayer(
                    f"{p}.conv1", self._counts[f"{p}.conv1"],
                    out=(*conv_out(f"{p}.conv1", bias=False), *bn_out(f"{p}.bn1")),
                    inp=(weight_in(f"{p}.conv2"),))))
                stream_in[in_stream].append(weight_in(f"{p}.conv1"))
                stream_out[stream] += [*conv_out(f"{p}.conv2", bias=False), *bn_out(f"{p}.bn2")]
                if getattr(self, stream)[b].shortcut:
                    stream_in[in_stream].append(weight_in(f"{p}.shortcut.0"))
                    stream_out[stream] += [*conv_out(f"{p}.shortcut.0", bias=False), *bn_out(f"{p}.shortcut.1")]
                in_stream = stream
        stream_in["layer4"].append(weight_in("fc"))
        streams = {s: ChannelLayer(s, self._counts[s], out=tuple(stream_out[s]), inp=tuple(stream_in[s]))
                   for s in stream_out}
        order = list(self.state_dict().keys())
        pos = {k: i for i, k in enumerate(order)}
        layers = list(streams.values()) + [lay for _, lay in inner]
        layers.sort(key=lambda lay: min(pos[ax.name] for ax in lay.out))
        return ChannelSpace(tuple(layers))


@register_model("resnet10")
def resnet10(*, num_classes: int, input_shape: tuple[int, ...] = (3, 32, 32), width_mult: float = 1.0,
             channels: Mapping[str, int] | None = None) -> ResNet:
    return ResNet((1, 1, 1, 1), num_classes=num_classes, input_shape=input_shape, width_mult=width_mult,
                  channels=channels)


@register_model("resnet18")
def resnet18(*, num_classes: int, input_shape: tuple[int, ...] = (3, 32, 32), width_mult: float = 1.0,
             channels: Mapping[str, int] | None = None) -> ResNet:
    return ResNet((2, 2, 2, 2), num_classes=num_classes, input_shape=input_shape, width_mult=width_mult,
                  channels=channels)
