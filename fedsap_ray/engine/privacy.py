"""Client-level DP around each round (``privacy.*``; docs/guides/privacy.md): the clipping of every update, the
local noise or the server's noisy sum, adaptive clipping, and the accountant's spend per round.

The round engines call it in this order (``Server.round``; the asynchronous engine per server step):

    results', columns = mechanism.clip(t, results, downloaded)   # each delta clipped to C (local: and noised)
    with mechanism.release(t):                                   # central: every merge is a noisy sum (dpnoise.py)
        out = strategy.aggregate(state, plans, results', t)
    out = mechanism.record(t, out, columns)                      # rounds.dp_*, clients.dp_*; C adapts; epsilon

What a client's update is: ``Delta_i = v_i - d_i`` over the coordinates of its result (``ClientResult.mask``),
``v_i`` what it trained and ``d_i`` what it downloaded there (the synchronous plan's start vector; the
asynchronous engine's downloaded version). Clipping (DP-FedAvg, McMahan et al. 2018, Algorithm 1
``ClipFn``): ``Delta_i <- Delta_i min(1, C / ||Delta_i||_2)``, so the values aggregated are
``d_i + clipped Delta_i`` (the trained values themselves, bit for bit, when nothing is clipped and there is no
local noise). The norm is over every coordinate the client uploads: weights, biases and BatchNorm's running
statistics alike (they are computed from its data too).

Adaptive clipping (Andrew et al. 2021, Algorithm 1 with the geometric update of their Eq. 2): each client's bit
b_i = [||Delta_i|| <= C]; the server releases b_noised = (sum_i (b_i - 1/2) + N(0, sigma_b^2) + m/2) / m, m the
expected clients per release, and sets C <- C exp(-eta_C (b_noised - gamma)) for the next round. The count's noise
is composed with the update's in the accountant (:func:`fedsap_ray.config.accountant.effective_multiplier`).

The round's noise is drawn from ``rng_for(seed, t, -1, "dp-noise")`` (central) and each local update's from
``rng_for(seed, t, client, "dp-local")``: a resumed round draws the same noise with no generator state to keep.
What does persist between rounds (C under adaptive clipping, the releases composed, each client's participations
under local DP) is :meth:`PrivateRounds.state_dict`, stored in the checkpoint.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from fedsap_ray.algorithms.dpnoise import NoisySum, noisy_sums
from fedsap_ray.common.messages import ClientResult, RoundOutput
from fedsap_ray.common.seeding import rng_for
from fedsap_ray.config.accountant import Ledger
from fedsap_ray.config.privacy_config import Noise, resolve
from fedsap_ray.config.schema import ExperimentConfig
from fedsap_ray.models.masks import ParamLayout

Downloaded = Callable[[ClientResult], np.ndarray]  # what a result's client downloaded at the result's coordinates


class PrivateRounds:
    """One run's mechanism and its accountant's ledger (module docstring)."""

    def __init__(self, cfg: ExperimentConfig, noise: Noise, variances: np.ndarray | None = None) -> None:
        self.cfg, self.noise, self.p = cfg, noise, cfg.privacy
        self.variances = variances  # bool [n_params]: BatchNorm running variances (post_process keeps them >= 0)
        self.clip_norm = float(self.p.clip_norm)
        self.ledger = Ledger(noise.releases, noise.sigma_eff)
        self.participations = np.zeros(cfg.data.num_clients, dtype=np.int64)  # local DP: releases per client
        self._open: NoisySum | None = None

    @classmethod
    def for_config(cls, cfg: ExperimentConfig, layout: ParamLayout | None = None) -> PrivateRounds | None:
        """The run's mechanism, or None with privacy off; ``layout`` names the running variances of the model."""
        noise = resolve(cfg)
        if noise is None:
            return None
        variances = None
        if layout is not None:
            variances = np.zeros(layout.size, dtype=bool)
            for name in layout.names:
                if name.endswith("running_var"):
                    lo, hi = layout.span(name)
                    variances[lo:hi] = True
        return cls(cfg, noise, variances if variances is not None and variances.any() else None)

    def post_process(self, params: np.ndarray) -> np.ndarray:
        """The released model with every BatchNorm running variance the noise pushed below 0 set to 0 (BatchNorm
        divides by sqrt(var + eps)): post-processing of the release, which costs no privacy (Dwork and Roth 2014,
        Prop. 2.1). ``params`` itself when nothing is negative."""
        if self.variances is None:
            return params
        neg = self.variances & (params < 0)
        if not neg.any():
            return params
        out = params.copy()
        out[neg] = 0.0
        return out

    @property
    def local(self) -> bool:
        return self.p.mode == "local"

    @property
    def poisson(self) -> bool:
        """Whether rounds are Poisson samples: a round may have no client, and still releases its noise."""
        return self.p.sampling == "poisson"

    # --- the round -----------------------------------------------------------------------------------------------
    def clip(self, t: int, results: list[ClientResult], downloaded: Downloaded
             ) -> tuple[list[ClientResult], dict[int, dict[str, Any]]]:
        """Each result with its delta clipped to C (and, under local DP, noised by its client), and per client its
        ``dp_update_norm`` (before clipping) and ``dp_clipped``. A result carrying anything besides its values is
        refused: only the update is covered by the mechanism."""
        out: list[ClientResult] = []
        columns: dict[int, dict[str, Any]] = {}
        c = self.clip_norm
        for r in results:
            if r.stats:
                raise RuntimeError(f"round {t}, client {r.client_id}: privacy covers the update only, but the client "
                                   f"uploaded {sorted(r.stats)} too (docs/readings.md#privacy)")
            d = downloaded(r)  # float32; numpy widens it exactly where it meets float64
            delta = r.values.astype(np.float64)
            delta -= d
            norm = float(math.sqrt(float(delta @ delta)))
            factor = 1.0 if norm <= c else c / norm
            columns[r.client_id] = {"dp_update_norm": norm, "dp_clipped": factor < 1.0}
            if factor == 1.0 and not self.local:
                out.append(r)  # nothing clipped: its trained values themselves, bit for bit
                continue
            delta *= factor
            if self.local:  # the client's own Gaussian on its clipped update (std sigma C)
                delta += rng_for(self.cfg.seed, t, r.client_id, "dp-local").standard_normal(delta.size) * (
                    self.noise.sigma * c)
            delta += d
            out.append(dataclasses.replace(r, values=delta.astype(np.float32)))
        return out, columns

    @contextlib.contextmanager
    def release(self, t: int) -> Iterator[None]:
        """Central DP: every merge inside is the round's noisy sum (:mod:`fedsap_ray.algorithms.dpnoise`); local DP:
        the ordinary merge of the already noised updates (every client weighing 1, as in the central sum)."""
        std = 0.0 if self.local else self.noise.sigma * self.clip_norm * self.noise.noise_scale
        self._open = NoisySum(std=std, denominator=self.p.denominator, cohort=float(self.noise.cohort),
                              rng=rng_for(self.cfg.seed, t, -1, "dp-noise"))
        with noisy_sums(self._open):
            yield

    def record(self, t: int, out: RoundOutput, columns: dict[int, dict[str, Any]]) -> RoundOutput:
        """The round's output with its ``dp_*`` columns (rounds and the aggregated clients' rows); then C adapts
        and the ledger composes the round's release."""
        release, self._open = self._open, None
        out = dataclasses.replace(out, state=dataclasses.replace(out.state, params=self.post_process(out.state.params)))
        used = self.clip_norm
        noised_fraction = None
        if self.p.clipping == "adaptive":
            m = float(self.noise.cohort)
            centred = sum((0.0 if col["dp_clipped"] else 1.0) - 0.5 for col in columns.values())
            noise = rng_for(self.cfg.seed, t, -1, "dp-count").standard_normal() * float(self.noise.count_sigma or 0.0)
            noised_fraction = (centred + noise + m / 2.0) / m
            self.clip_norm = used * math.exp(-self.p.clip_lr * (noised_fraction - self.p.target_quantile))
        if self.local:
            for cid in columns:
                self.participations[cid] += 1
            self.ledger.advance(int(self.participations.max()) - self.ledger.steps)
        else:
            self.ledger.advance(1)
        central = release if release is not None and not self.local else None  # local: the server adds none
        rounds = dict(dp_epsilon=self.ledger.epsilon(), dp_clip_norm=used,
                      dp_noise_std=None if central is None else central.std,
                      dp_snr_shared=None if central is None else central.snr("shared"),
                      dp_snr_partial=None if central is None else central.snr("partial"),
                      dp_unclipped_noised=noised_fraction)
        recs = out.records
        clients = {cid: {**row, **columns.get(cid, {})} for cid, row in recs.clients.items()}
        return dataclasses.replace(out, records=dataclasses.replace(recs, rounds={**recs.rounds, **rounds},
                                                                    clients=clients))

    # --- the checkpoint ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What the next round needs besides the config: C, the releases composed, the local participations."""
        return {"clip_norm": float(self.clip_norm), "releases": int(self.ledger.steps),
                "participations": self.participations.copy()}

    def load_state_dict(self, tree: Any, where: str) -> None:
        """Restore :meth:`state_dict`'s tree (checked: a ValueError naming ``where`` and the key)."""
        if not isinstance(tree, dict) or set(tree) != {"clip_norm", "releases", "participations"}:
            raise ValueError(f"{where}: its privacy state is not the clip norm, the releases and the participations")
        c, n, part = tree["clip_norm"], tree["releases"], tree["participations"]
        if not (isinstance(c, float) and math.isfinite(c) and c > 0):
            raise ValueError(f"{where}: privacy clip_norm {c!r} is not a finite number > 0")
        if not (isinstance(n, int) and n >= 0):
            raise ValueError(f"{where}: privacy releases {n!r} is not an integer >= 0")
        if not (isinstance(part, np.ndarray) and part.shape == self.participations.shape and part.dtype == np.int64):
            raise ValueError(f"{where}: privacy participations is not one count per client")
        self.clip_norm = c
        self.ledger = Ledger(self.noise.releases, self.noise.sigma_eff, n)
        self.participations = part.copy()
