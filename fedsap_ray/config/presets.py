"""The presets: named, nested dicts applied over the config's defaults (``--preset``), and what each is for.

Apart from the assembling (:mod:`fedsap_ray.config.build`) because they are data a study reads and changes
(the papers' protocols and their laptop-scale versions), not code; the generated configuration reference lists
every preset with its line in :data:`PRESET_NOTES`.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any


# ---------------------------------------------------------------------------------
# Presets: nested dicts applied over the defaults.
# ---------------------------------------------------------------------------------
PRESETS: dict[str, dict[str, Any]] = {
    # seconds: a tiny federation on the embedded dataset, every code path exercised
    "smoke": {
        "data": {"name": "embedded_digits", "num_clients": 10, "client_fraction": 0.02,
                 "max_test_per_domain": 200},
        "model": {"name": "resnet10", "width_mult": 0.125},
        "training": {"rounds": 4, "local_epochs": 1, "batch_size": 32, "lr": 0.05},
    },
    # minutes on 2 CPU cores: the embedded four-domain benchmark, Digits protocol
    "laptop": {
        "data": {"name": "embedded_digits", "num_clients": 10, "client_fraction": 0.1,
                 "max_test_per_domain": 500},
        "model": {"name": "resnet10", "width_mult": 0.25},
        # deployed models every 5th round and the last: the final deployed figures and every paper figure
        # (best-so-far global accuracy, evaluated every round) are unchanged; docs/guides/performance.md
        "training": {"rounds": 25, "local_epochs": 2, "batch_size": 32, "lr": 0.05, "deployed_every": 5},
    },
    # the published Digits protocol (papers/000 Appendix C, Table 4); other datasets via --set
    "paper": {
        "data": {"name": "digits", "num_clients": 10, "client_fraction": 0.01, "partition": "domain"},
        "model": {"name": "resnet10", "width_mult": 1.0},
        "training": {"rounds": 100, "local_epochs": 10, "batch_size": 64, "lr": 0.01,
                     "momentum": 0.9, "weight_decay": 5e-4},
    },
}
DEFAULT_PRESET = "laptop"


def deep_merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) and k != "options":
            out[k] = deep_merge(dict(out[k]), v)
        elif isinstance(v, Mapping) and k == "options" and isinstance(out.get(k), Mapping):
            out[k] = {**out[k], **v}
        else:
            out[k] = v
    return out


# papers/003 section 4.1: 20 clients, Dirichlet(0.3) (natural roles for Shakespeare), p_max tiers
# {0.25, 0.5, 0.75, 1.0} with mean 0.525 ("resource-constrained devices more prevalent"; the split is not
# given: 7 x 0.25 / 7 x 0.5 / 3 x 0.75 / 3 x 1.0 is our reading, docs/readings.md), 10 clients per round, 200 rounds, lr 0.01 decayed by
# 0.995 per round, SGD momentum 0.9, weight decay 1e-4, clipping at 10, K = 5 (CIFAR-10) or 1
# local epochs. The batch size is not stated in the paper: 64. HAS-FL's p_min 0.4, gamma 0.25,
# beta 0.9, T_adapt 5, warm-up 10, T_norm 20 are the hasfl strategy's defaults.
_CONFOUND: dict[str, Any] = {
    "data": {"partition": "dirichlet", "alpha": 0.3, "num_clients": 20},
    "capacity": {"scheme": "tiers", "tiers": [0.25, 0.5, 0.75, 1.0], "tier_shares": [7, 7, 3, 3]},
    "training": {"rounds": 200, "local_epochs": 5, "batch_size": 64, "lr": 0.01, "lr_decay": 0.995,
                 "momentum": 0.9, "weight_decay": 1e-4, "grad_clip": 10.0, "participation": 0.5},
}
PRESETS["paper_cifar10"] = deep_merge(_CONFOUND, {"data": {"name": "cifar10"}, "model": {"name": "cnn_cifar"}})
PRESETS["paper_emnist"] = deep_merge(_CONFOUND, {"data": {"name": "emnist"}, "model": {"name": "cnn_emnist"},
                                                 "training": {"local_epochs": 1}})
# Shakespeare: the 20 roles with the most dialogue, K = 1, lr 0.1, clipping at 5 (section 4.1)
PRESETS["paper_shakespeare"] = deep_merge(_CONFOUND, {
    "data": {"name": "shakespeare", "partition": "natural"}, "model": {"name": "char_lstm"},
    "training": {"local_epochs": 1, "lr": 0.1, "grad_clip": 5.0}})
# the same protocol at laptop scale on real MNIST (../shared/data/mnist): 20,000 training images over
# 20 clients, the small CNN at half width, 50 rounds of one local epoch (HAS-FL keeps warm-up 10,
# T_adapt 5, T_norm 20: 8 adaptation steps, 2 normalisations). The deployed models are evaluated every
# 10th round and the last, as in the other confound presets: every round, the 20 deployed evaluations
# (BN calibration + 2,000 test images each) took about 7.5 s of a 9.0 s round (cProfile and
# benchmarks/submodel_speed.py); trained numbers do not depend on it
PRESETS["confound_laptop"] = deep_merge(_CONFOUND, {
    "data": {"name": "mnist", "max_train_per_domain": 20000, "max_test_per_domain": 2000},
    "model": {"name": "cnn_small", "width_mult": 0.5},
    "training": {"rounds": 50, "local_epochs": 1, "batch_size": 32, "deployed_every": 10}})
# CIFAR-10 at laptop scale: the paper_cifar10 protocol shrunk (issue 14 names this reading): 3,000 training
# images (150 a client), 1,000 test images, the CIFAR-10 CNN at half width, 30 rounds of two local epochs
# (the paper's K = 5 would triple the cost; 30 rounds keep HAS-FL's warm-up 10, T_adapt 5, T_norm 20:
# 4 adaptation steps, one normalisation). The deployed models (each as costly to evaluate as a few rounds of
# training here) are evaluated every 10th round for a seeded half of the clients.
PRESETS["confound_cifar10"] = deep_merge(PRESETS["paper_cifar10"], {
    "data": {"max_train_per_domain": 3000, "max_test_per_domain": 1000}, "model": {"width_mult": 0.5},
    "training": {"rounds": 30, "local_epochs": 2, "deployed_every": 10, "eval_clients": 10}})
# Shakespeare at laptop scale: the 20 roles with the most lines (chosen on the full split), 20,000 of
# their training windows (stride 8) and 2,000 of their held-out windows, the LSTM at half width (128
# hidden units), 20 rounds of two local epochs at batch 16 (the paper's lr 0.1, clipping 5, K = 1 and
# batch 64 give ~6 steps a client per round: 30 such rounds never left the most-frequent-character
# baseline, issue 14). HAS-FL keeps warm-up 10, T_adapt 5, T_norm 20: 3 adaptation steps. Deployed models
# as in confound_cifar10 (every 10th round, 10 clients): one evaluation costs about a round's training.
PRESETS["confound_shakespeare"] = deep_merge(PRESETS["paper_shakespeare"], {
    "data": {"max_train_per_domain": 20000, "max_test_per_domain": 2000},
    "model": {"width_mult": 0.5}, "training": {"rounds": 20, "local_epochs": 2, "batch_size": 16,
                                               "deployed_every": 10, "eval_clients": 10}})

# What each preset is for, one line each (the generated docs/reference/config.md lists them; a
# preset without a line here fails the docs check).
PRESET_NOTES: dict[str, str] = {
    "smoke": "seconds: a tiny federation on the embedded data in which every mechanism runs (FedSAP warm-up 1 "
             "and a DGA regrouping every round; HAS-FL and Random-budget warm-up 2, adaptation every round)",
    "laptop": "the default: minutes on 2 CPU cores, the embedded four-domain digits under the Digits protocol "
              "(FedSAP warm-up 5, regrouping every 5 rounds), deployed models evaluated every 5th round",
    "paper": "the published Digits protocol (papers/000 Appendix C, Table 4): real Digits, 10 clients with 1% "
             "of their domain each, ResNet10, 100 rounds of 10 local epochs",
    "paper_cifar10": "papers/003 section 4.1 on CIFAR-10: 20 clients, Dirichlet(0.3), p_max tiers (mean 0.525 as in the "
                     "paper; our split, the paper gives none) 7x0.25 / "
                     "7x0.5 / 3x0.75 / 3x1.0, 10 clients a round, 200 rounds of 5 local epochs, the CIFAR-10 CNN",
    "paper_emnist": "the same protocol on EMNIST ByClass with the EMNIST CNN and one local epoch",
    "paper_shakespeare": "the same protocol on Shakespeare: the 20 roles with the most lines, the character "
                         "LSTM, one local epoch, lr 0.1, clipping at 5",
    "confound_laptop": "the papers/003 protocol at laptop scale on real MNIST from ../shared/data: 20,000 "
                       "training images, cnn_small at half width, 50 rounds of one local epoch, deployed models evaluated every 10th round",
    "confound_cifar10": "the paper_cifar10 protocol shrunk to laptop scale on the shared CIFAR-10 files: 3,000 "
                        "training and 1,000 test images, the CIFAR-10 CNN at half width, 30 rounds of two local "
                        "epochs, deployed models of a seeded half of the clients evaluated every 10th round",
    "confound_shakespeare": "the papers/003 Shakespeare protocol at laptop scale on the shared LEAF files: the 20 "
                            "roles with the most lines, 20,000 of their training windows and 2,000 of their held-out "
                            "windows, char_lstm at half width, 20 rounds of two local epochs at batch 16",
}
