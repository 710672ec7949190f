"""FedSAP's options (papers/000 Appendix B Table 3 and our readings, docs/readings.md#fedsap-papers000)."""
from __future__ import annotations

from dataclasses import dataclass

from fedsap_ray.algorithms.contract import Strategy
from fedsap_ray.algorithms.fedsap.dga import DGA_METHODS, DGA_MODES
from fedsap_ray.config.checks import check_choice, check_int, check_number

MASK_MODES = ("dynamic", "fixed")
SMOOTHING = ("dispersion", "statistics")
STABILITY = ("none", "hysteresis", "swap_budget")
RANKINGS = ("client", "pooled")
DGA_LAYERS = ("conv1", "layer1", "layer2", "layer3")
DGA_SOURCES = ("train", "probe")


@dataclass(frozen=True)
class FedSAPOptions(Strategy.Options):
    """Defaults: the paper's main adaptive configuration (papers/000 Appendix B Table 3, left)."""

    adaptive_layer_budget: int = 1  # 1: utility-driven layer budgets (Eq. 2); 0: the client's capacity in every layer
    temperature: float = 1.0  # softmax temperature over the layer utilities (Eq. 2)
    lambda_a: float = 0.5  # weight of the activation magnitude in a channel's utility (Eq. 5)
    lambda_g: float = 0.5  # weight of the gradient magnitude in a channel's utility (Eq. 5)
    g_target: float = 0.9  # least share of Global channels among a layer's active ones (Eq. 3)
    tau_var: float = 0.05  # dispersion threshold: an active channel above it is Private (Eq. 6)
    beta_ema: float = 0.5  # EMA coefficient of the dispersion (Eq. 6)
    gamma: float = 0.01  # weight of the representation regulariser gamma * ||f_enc(x)||^2 (Eq. 7)
    masks: str = "dynamic"  # dynamic: new masks every round; fixed: the masks of the end of warm-up, kept
    sgp: bool = True  # false: every active channel Global (a single aggregation path, no Private channels)
    # pseudo-groups: gradient (Eq. 4), none (one per client), oracle (true domains), random (matched sizes)
    dga: str = "gradient"
    dga_layer: str = "conv1"  # whose gradient DGA compares (papers/000 Table 2)
    dga_method: str = "components"  # components: connected components of the thresholded similarity; agglomerative
    tau_sim: float = 0.5  # cosine-similarity threshold of DGA (Eq. 4)
    warmup: int = 10  # rounds in which every active channel is Global; the first DGA closes the warm-up
    regroup_every: int = 5  # R_d, rounds between DGA regroupings
    # probe (the default, docs/studies/mask-stability.md): one common sub-model's gradient on every client, see the
    # strategy's docstring; train: the paper's gradient after local training (Eq. 4's input as written)
    dga_source: str = "probe"
    probe_samples: int = 256  # samples per client in the probe gradient (dga_source=probe)
    # Stable masks (docs/readings.md#stable-masks). smoothing: what beta_ema smooths (dispersion: Eq. 6's d~
    # only; statistics: also each client's utilities and the layer utilities, Appendix C's "channel statistics")
    # Defaults from docs/studies/mask-stability.md (pooled-budget-probe, 3 seeds, against today-train): the narrow
    # clients' swaps 41% -> 9% a round, worst client 59.4 -> 81.9, deployed 86.8 -> 92.3; the full-width best
    # 86.5 -> 84.3 (within seed noise)
    smoothing: str = "statistics"
    stability: str = "swap_budget"  # none: top-n_l by score; hysteresis: a held channel leaves only for a margin
    margin: float = 0.1  # hysteresis: how much a candidate's utility must beat a held channel's to replace it
    swap_budget: float = 0.1  # swap_budget: most of a client's active channels that may change in one round
    ranking: str = "pooled"  # pooled: one shared ranking (the federation estimate); client: own utilities where held

    def __post_init__(self) -> None:
        check_choice("algorithm.adaptive_layer_budget", self.adaptive_layer_budget, (0, 1))
        check_number("algorithm.g_target", self.g_target, 0, 1)
        check_number("algorithm.beta_ema", self.beta_ema, 0, 1, high_open=True)
        check_number("algorithm.temperature", self.temperature, 0, low_open=True)
        for f in ("lambda_a", "lambda_g", "tau_var", "gamma", "margin"):
            check_number(f"algorithm.{f}", getattr(self, f), 0)
        check_number("algorithm.tau_sim", self.tau_sim, -1, 1, note=" (a cosine similarity)")
        for f, choices in (("masks", MASK_MODES), ("dga", DGA_MODES), ("dga_layer", DGA_LAYERS),
                           ("dga_method", DGA_METHODS), ("dga_source", DGA_SOURCES), ("smoothing", SMOOTHING),
                           ("stability", STABILITY), ("ranking", RANKINGS)):
            check_choice(f"algorithm.{f}", getattr(self, f), choices)
        check_int("algorithm.warmup", self.warmup, 0)
        check_int("algorithm.regroup_every", self.regroup_every, 1)
        check_number("algorithm.swap_budget", self.swap_budget, 0, 1, low_open=True,
                     note=" (a share of the client's active channels)")
        check_int("algorithm.probe_samples", self.probe_samples, 2)
