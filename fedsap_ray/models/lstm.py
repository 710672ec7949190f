"""Maskable character LSTM ``char_lstm`` (papers/003 section 4.1, Shakespeare).

8-dim character embedding, two LSTM layers of 256 hidden units, a linear projection to
the vocabulary (95 symbols) applied to the LAST time step: a sequence of 80 characters
predicts the following character. Reading the last step only is what papers/003
Table 1 counts: 63.6M MACs per sample = 80 x (4*256*(8+256) + 4*256*(256+256)) +
256*95, and 0.82M parameters (both PyTorch bias vectors of each layer included).

Channels are hidden units. Each of the two layers is its own ``nn.LSTM`` (``lstm0``,
``lstm1``) so a physically sliced sub-model may give the layers different widths. A
hidden unit owns one row in each of the 4 gate blocks (i, f, g, o) of ``weight_ih``,
``weight_hh`` and both biases (``ParamAxis(blocks=4)``), and the column of
``weight_hh``/next ``weight_ih``/``fc.weight`` that reads it. The embedding and the
output rows (classes) are shared in full (papers/003: "the embedding and output bias
are shared in full by every client"). A dropped unit with all its gate rows zeroed
has i=f=o=0.5, g=0, so its cell and hidden state stay exactly 0 from a zero state:
the masked full-size LSTM computes the same as the sliced one.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from fedsap_ray.models.resnet import scaled
from fedsap_ray.config.registry import register_model
from fedsap_ray.models.space import ChannelLayer, ChannelSpace, MaskableModel, ParamAxis, weight_in

GATES = 4  # i, f, g, o blocks of PyTorch's LSTM weights


def _gate_rows(module: str) -> tuple[ParamAxis, ...]:
    return tuple(ParamAxis(f"{module}.{t}_l0", 0, blocks=GATES)
                 for t in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"))


@register_model("char_lstm")
class CharLSTM(MaskableModel):
    """Embedding -> LSTM -> LSTM -> linear(vocab) on the last step; input int64 [B, T]."""

    input_dtype = torch.long
    EMBED = 8
    HIDDEN = 256

    def __init__(self, *, num_classes: int, input_shape: tuple[int, ...] = (80,), width_mult: float = 1.0,
                 vocab_size: int | None = None, channels: Mapping[str, int] | None = None) -> None:
        super().__init__()
        if len(input_shape) != 1:
            raise ValueError(f"char_lstm: input_shape must be (sequence_length,), got {input_shape}")
        self.input_shape = (int(input_shape[0]),)
        self.vocab_size = int(vocab_size if vocab_size is not None else num_classes)
        counts = {"lstm0": scaled(self.HIDDEN, width_mult), "lstm1": scaled(self.HIDDEN, width_mult)}
        if channels:
            unknown = set(channels) - set(counts)
            if unknown:
                raise ValueError(f"char_lstm: unknown channel layers {sorted(unknown)}; layers are {list(counts)}")
            counts.update({k: int(v) for k, v in channels.items()})
        self._counts = counts
        self.embedding = nn.Embedding(self.vocab_size, self.EMBED)
        self.lstm0 = nn.LSTM(self.EMBED, counts["lstm0"], batch_first=True)
        self.lstm1 = nn.LSTM(counts["lstm0"], counts["lstm1"], batch_first=True)
        self.feature_dim = counts["lstm1"]
        self.fc = nn.Linear(self.feature_dim, num_classes)
        self.classifier = "fc"

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm0(self.embedding(x))
        out, _ = self.lstm1(out)
        return out[:, -1]

    def activation_modules(self) -> dict[str, list[str]]:
        """Per channel layer, the ``nn.LSTM`` whose output tuple's [0] ([B, T, H], batch_first) carries
        its hidden units on the LAST dim: the hidden state h_t of every time step."""
        return {"lstm0": ["lstm0"], "lstm1": ["lstm1"]}

    def channel_space(self) -> ChannelSpace:
        return ChannelSpace((
            ChannelLayer("lstm0", self._counts["lstm0"], out=_gate_rows("lstm0"),
                         inp=(ParamAxis("lstm0.weight_hh_l0", 1), ParamAxis("lstm1.weight_ih_l0", 1))),
            ChannelLayer("lstm1", self._counts["lstm1"], out=_gate_rows("lstm1"),
                         inp=(ParamAxis("lstm1.weight_hh_l0", 1), weight_in("fc"))),
        ))
