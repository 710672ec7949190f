"""Maskable CNNs and an MLP: ``cnn_small``, ``cnn_cifar``/``cnn_emnist`` (papers/003) and ``mlp``.

papers/003 names its image models only "CIFAR-10 CNN" and "EMNIST CNN"; its Table 1
(parameters, MACs per sample and upload at widths 0.25/0.5/0.75/1) pins them down. The
network below reproduces every entry of that table (tests/models/test_models.py checks it):

    [conv3x3(c_in->64)-BN-ReLU, conv3x3(64->64)-BN-ReLU, maxpool2] x widths 64/128/256,
    flatten (256 x 4 x 4 = 4096), linear 4096->512, ReLU, linear 512->classes

with conv biases and BatchNorm affine parameters counted as parameters (BN running
statistics are buffers). CIFAR-10: 3x32x32 input, 10 classes -> 3.248M parameters,
154.9M MACs. EMNIST: 1x28x28 input, 62 classes; the third max-pool uses ``ceil_mode``
(7x7 -> 4x4), the only choice that gives Table 1's 3.28M parameters and 118.2M MACs.
``ceil_mode`` changes nothing on 32x32 inputs, so both names build one class.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from fedsap_ray.models.resnet import scaled
from fedsap_ray.config.registry import register_model
from fedsap_ray.models.space import ChannelLayer, ChannelSpace, MaskableModel, bn_out, conv_out, weight_in


def _resolve(defaults: dict[str, int], channels: Mapping[str, int] | None, who: str) -> dict[str, int]:
    counts = dict(defaults)
    if channels:
        unknown = set(channels) - set(counts)
        if unknown:
            raise ValueError(f"{who}: unknown channel layers {sorted(unknown)}; layers are {list(counts)}")
        counts.update({k: int(v) for k, v in channels.items()})
    return counts


def _image_shape(input_shape: tuple[int, ...], who: str) -> tuple[int, int, int]:
    if len(input_shape) != 3:
        raise ValueError(f"{who}: input_shape must be (C, H, W), got {input_shape}")
    return int(input_shape[0]), int(input_shape[1]), int(input_shape[2])


@register_model("cnn_small")
class CNNSmall(MaskableModel):
    """conv3x3(3->32)-ReLU-pool2, conv3x3(32->64)-ReLU-pool2, linear(64*H/4*W/4 -> classes); no BN."""

    input_dtype = torch.float32

    def __init__(self, *, num_classes: int, input_shape: tuple[int, ...] = (3, 32, 32), width_mult: float = 1.0,
                 channels: Mapping[str, int] | None = None) -> None:
        super().__init__()
        c_in, h, w = _image_shape(input_shape, "cnn_small")
        self.input_shape = (c_in, h, w)
        self._counts = _resolve({"conv1": scaled(32, width_mult), "conv2": scaled(64, width_mult)}, channels,
                                "cnn_small")
        self.conv1 = nn.Conv2d(c_in, self._counts["conv1"], 3, padding=1)
        self.conv2 = nn.Conv2d(self._counts["conv1"], self._counts["conv2"], 3, padding=1)
        self._spatial = (h // 4) * (w // 4)  # two floor-mode 2x2 max-pools
        if self._spatial < 1:
            raise ValueError(f"cnn_small: input {input_shape} is too small for two 2x2 max-pools")
        self.feature_dim = self._counts["conv2"] * self._spatial
        self.fc = nn.Linear(self.feature_dim, num_classes)
        self.classifier = "fc"

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return torch.flatten(x, 1)  # [C, H, W] order: channel c owns `spatial` consecutive entries

    def activation_modules(self) -> dict[str, list[str]]:
        """Per channel layer, the module whose output carries its channels on dim 1: the conv (pre-ReLU)."""
        return {"conv1": ["conv1"], "conv2": ["conv2"]}

    def channel_space(self) -> ChannelSpace:
        return ChannelSpace((
            ChannelLayer("conv1", self._counts["conv1"], out=conv_out("conv1", bias=True), inp=(weight_in("conv2"),)),
            ChannelLayer("conv2", self._counts["conv2"], out=conv_out("conv2", bias=True),
                         inp=(weight_in("fc", group=self._spatial),)),
        ))


@register_model("cnn_emnist")  # (decorators apply bottom-up: cnn_cifar is registered first)
@register_model("cnn_cifar")
class CNN6(MaskableModel):
    """The papers/003 CIFAR-10 / EMNIST CNN (see the module docstring for how Table 1 fixes it)."""

    input_dtype = torch.float32
    CONV_WIDTHS = (64, 64, 128, 128, 256, 256)
    HIDDEN = 512

    def __init__(self, *, num_classes: int, input_shape: tuple[int, ...] = (3, 32, 32), width_mult: float = 1.0,
                 channels: Mapping[str, int] | None = None) -> None:
        super().__init__()
        c_in, h, w = _image_shape(input_shape, "cnn6")
        self.input_shape = (c_in, h, w)
        defaults = {f"conv{i + 1}": scaled(c, width_mult) for i, c in enumerate(self.CONV_WIDTHS)}
        defaults["fc1"] = scaled(self.HIDDEN, width_mult)
        self._counts = _resolve(defaults, channels, "cnn6")
        prev = c_in
        for i in range(6):
            c = self._counts[f"conv{i + 1}"]
            setattr(self, f"conv{i + 1}", nn.Conv2d(prev, c, 3, padding=1))
            setattr(self, f"bn{i + 1}", nn.BatchNorm2d(c))
            prev = c
        for _ in range(3):
            h, w = math.ceil(h / 2), math.ceil(w / 2)  # max_pool2d(2, ceil_mode=True)
        self._spatial = h * w
        self.fc1 = nn.Linear(prev * self._spatial, self._counts["fc1"])
        self.feature_dim = self._counts["fc1"]
        self.fc2 = nn.Linear(self.feature_dim, num_classes)
        self.classifier = "fc2"

    def conv_bn_pairs(self) -> list[tuple[str, str]]:
        """``convN`` -> ``bnN``: each BN reads its conv's output only."""
        return [(f"conv{i + 1}", f"bn{i + 1}") for i in range(6)]

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(6):
            x = F.relu(getattr(self, f"bn{i + 1}")(getattr(self, f"conv{i + 1}")(x)))
            if i % 2 == 1:
                x = F.max_pool2d(x, 2, ceil_mode=True)
        return F.relu(self.fc1(torch.flatten(x, 1)))

    def activation_modules(self) -> dict[str, list[str]]:
        """Per channel layer, the module whose output carries its channels on dim 1: ``convN`` -> its
        BatchNorm ``bnN`` (pre-ReLU), ``fc1`` -> the linear output (pre-ReLU)."""
        return {**{f"conv{i}": [f"bn{i}"] for i in range(1, 7)}, "fc1": ["fc1"]}

    def channel_space(self) -> ChannelSpace:
        layers = []
        for i in range(1, 7):
            nxt = weight_in(f"conv{i + 1}") if i < 6 else weight_in("fc1", group=self._spatial)
            layers.append(ChannelLayer(f"conv{i}", self._counts[f"conv{i}"],
                                       out=(*conv_out(f"conv{i}", bias=True), *bn_out(f"bn{i}")), inp=(nxt,)))
        layers.append(ChannelLayer("fc1", self._counts["fc1"], out=conv_out("fc1", bias=True),
                                   inp=(weight_in("fc2"),)))
        return ChannelSpace(tuple(layers))


@register_model("mlp")
class MLP(MaskableModel):
    """Feature-vector classifier 800 -> 512 -> 256 -> classes with ReLU; both hidden layers maskable."""

    input_dtype = torch.float32
    HIDDEN = (512, 256)

    def __init__(self, *, num_classes: int, input_shape: tuple[int, ...] = (800,), width_mult: float = 1.0,
                 channels: Mapping[str, int] | None = None) -> None:
        super().__init__()
        if len(input_shape) != 1:
            raise ValueError(f"mlp: input_shape must be (features,), got {input_shape}")
        self.input_shape = (int(input_shape[0]),)
        self._counts = _resolve({"fc1": scaled(self.HIDDEN[0], width_mult), "fc2": scaled(self.HIDDEN[1], width_mult)},
                                channels, "mlp")
        self.fc1 = nn.Linear(self.input_shape[0], self._counts["fc1"])
        self.fc2 = nn.Linear(self._counts["fc1"], self._counts["fc2"])
        self.feature_dim = self._counts["fc2"]
        self.fc3 = nn.Linear(self.feature_dim, num_classes)
        self.classifier = "fc3"

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.fc2(F.relu(self.fc1(x))))

    def activation_modules(self) -> dict[str, list[str]]:
        """Per channel layer, the module whose output carries its channels on dim 1: the linear (pre-ReLU)."""
        return {"fc1": ["fc1"], "fc2": ["fc2"]}

    def channel_space(self) -> ChannelSpace:
        return ChannelSpace((
            ChannelLayer("fc1", self._counts["fc1"], out=conv_out("fc1", bias=True), inp=(weight_in("fc2"),)),
            ChannelLayer("fc2", self._counts["fc2"], out=conv_out("fc2", bias=True), inp=(weight_in("fc3"),)),
        ))
