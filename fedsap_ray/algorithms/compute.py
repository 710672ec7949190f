"""Honest compute (issue 13): what the sub-model a client trained costs per sample, counted from the model itself,
so a strategy's ``train_macs`` and ``macs_per_sample`` columns say what its clients really ran."""
from __future__ import annotations

import numpy as np

from fedsap_ray.algorithms.memo import Memo
from fedsap_ray.algorithms.context import StrategyContext
from fedsap_ray.models import model_macs, weight_uses


class Compute:
    """Multiply-accumulate counts over the run's model (``ctx.model`` at its input shape); a strategy holds one as
    ``self.compute`` and shares its :class:`Memo` with it."""

    def __init__(self, ctx: StrategyContext, memo: Memo) -> None:
        self.ctx, self.memo = ctx, memo

    def mask_macs(self, mask: np.ndarray | None) -> int:
        """Multiply-accumulates per sample of the sub-model a parameter mask covers (papers/003 Table 1).

        Sum over weight tensors of (covered entries) x (applications per sample): exactly
        :func:`fedsap_ray.models.model_macs` of the channel masks the coverage came from
        (tests/algorithms/test_feddrop.py), and it also counts sub-models a channel mask alone cannot
        describe (NeFL's skipped residual branches). ``None``: the full model (memoised).
        """
        if mask is None:
            return self.memo("full_model_macs", None,
                             lambda: int(model_macs(self.ctx.model, self.ctx.federation.input_shape, None)))
        uses = weight_uses(self.ctx.model, self.ctx.federation.input_shape)
        layout = self.ctx.layout
        return int(sum(int(np.count_nonzero(layout.slice(w, mask))) * n for w, n in uses.items()))

    def encoder_macs(self) -> int:
        """Per-sample MACs of ``model.forward_features`` alone: the full model minus its classifier's weights.

        What a frozen model run for its representation costs (MOON's global and previous models).
        """
        uses = weight_uses(self.ctx.model, self.ctx.federation.input_shape)
        head = self.ctx.model.classifier + "."
        layout = self.ctx.layout
        cls = sum(int(np.prod(layout.shapes[layout.names.index(w)])) * n for w, n in uses.items() if w.startswith(head))
        return self.mask_macs(None) - int(cls)
