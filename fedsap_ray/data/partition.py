"""Client partitions and ground-truth heterogeneity (papers/003 section 4.4;
docs/guides/data.md#partitions-and-capacities).

Pure numpy. Every random partitioner takes ``rng``: an ``np.random.Generator`` or an int
seed; an int is expanded as ``SeedSequence((seed, purpose))`` with a purpose constant per
partitioner, so the same seed never yields correlated streams across partitioners.
Index arrays are int64 and sorted within a client (cache-friendly gathers; the training
loop shuffles anyway).
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

RngLike = np.random.Generator | int

_PURPOSE_DOMAIN = 401
_PURPOSE_DIRICHLET = 402
_PURPOSE_IID = 403


def as_rng(rng: RngLike, purpose: int) -> np.random.Generator:
    """A Generator as given, or one seeded from ``SeedSequence((seed, purpose))``."""
    if isinstance(rng, np.random.Generator):
        return rng
    if isinstance(rng, (int, np.integer)) and not isinstance(rng, bool) and rng >= 0:
        return np.random.default_rng(np.random.SeedSequence((int(rng), purpose)))
    raise TypeError(f"rng must be a numpy Generator or a non-negative int seed, got {rng!r}")


class PartitionError(ValueError):
    """A partition the config asks for cannot be made from the data: ``field`` names the
    config field to change and ``value`` its value, so a run can refuse it as bad input
    (exit 2) before any training."""

    def __init__(self, field: str, value: object, message: str) -> None:
        super().__init__(message)
        self.field, self.value = field, value


def _check_clients(num_clients: int) -> None:
    if not isinstance(num_clients, (int, np.integer)) or isinstance(num_clients, bool) or num_clients < 1:
        raise ValueError(f"num_clients must be an integer >= 1, got {num_clients!r}")


def _round_half_up(x: float) -> int:
    return int(math.floor(x + 0.5))


def assign_domains(domains: list[str], num_clients: int, rng: RngLike) -> list[str]:
    """True domain per client id: one client per domain in order, then uniform random draws.

    Clients 0..D-1 get the D domains in the given order; clients D..N-1 draw a domain
    uniformly at random with replacement (docs/readings.md#digits-and-office-caltech10-protocol: one client per
    domain, the other six drawn uniformly over the four domains).
    """
    _check_clients(num_clients)
    if not domains:
        raise ValueError("at least one domain is needed")
    if num_clients < len(domains):
        raise PartitionError("data.num_clients", num_clients,
                             f"every domain needs a client: num_clients={num_clients} < {len(domains)} domains "
                             f"({', '.join(domains)}); use at least {len(domains)} clients")
    extra = as_rng(rng, _PURPOSE_DOMAIN).integers(0, len(domains), num_clients - len(domains))
    return list(domains) + [domains[int(k)] for k in extra]


def domain_protocol(domain_sizes: Mapping[str, int], num_clients: int, fraction: float,
                    rng: RngLike) -> list[tuple[str, np.ndarray]]:
    """Digits/Office protocol (following DapperFL): clients over domains
    (docs/readings.md#digits-and-office-caltech10-protocol).

    Domains per client id come from :func:`assign_domains` (ids 0..D-1: one per domain in
    the given order; ids D..N-1: uniform random draws, in draw order).
    Each client receives ``max(1, round_half_up(fraction * n_d))`` indices into its
    domain's training pool, drawn without replacement among the clients of that domain
    (disjoint within a domain) from one random permutation of the pool.
    """
    _check_clients(num_clients)
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction (data.client_fraction) must be in (0, 1], got {fraction!r}")
    domains = list(domain_sizes)
    for d, n in domain_sizes.items():
        if n < 1:
            raise ValueError(f"domain {d!r} has an empty training pool")
    gen = as_rng(rng, _PURPOSE_DOMAIN)
    client_domain = assign_domains(domains, num_clients, gen)
    out: list[tuple[str, np.ndarray] | None] = [None] * num_clients
    for d in domains:  # permutations drawn in domain order: deterministic for the generator
        n = int(domain_sizes[d])
        m = max(1, _round_half_up(fraction * n))
        ids = [i for i, cd in enumerate(client_domain) if cd == d]
        if len(ids) > n:
            raise PartitionError("data.num_clients", num_clients,
                                 f"{len(ids)} clients drawn for domain {d!r} but it has only {n} training samples "
                                 "(every client needs at least one); use fewer clients")
        if m * len(ids) > n:
            raise PartitionError("data.client_fraction", fraction,
                                 f"data.client_fraction={fraction} is too large for domain {d!r}: {len(ids)} clients x "
                                 f"{m} samples > {n} training samples (disjoint draws); lower the fraction")
        perm = gen.permutation(n)
        for j, cid in enumerate(ids):
            out[cid] = (d, np.sort(perm[j * m:(j + 1) * m]).astype(np.int64))
    return [o for o in out if o is not None]


def office_split(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Office-Caltech10 train/test split: sample i trains when i % 10 <= 7
    (docs/readings.md#digits-and-office-caltech10-protocol)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    i = np.arange(n, dtype=np.int64)
    return i[i % 10 <= 7], i[i % 10 > 7]


def dirichlet_label_skew(labels: np.ndarray, num_clients: int, alpha: float, rng: RngLike,
                         min_samples: int = 10, max_tries: int = 1000) -> list[np.ndarray]:
    """Per-class Dirichlet(alpha) label skew (Hsu et al. 2019; NIID-Bench, Li et al. 2022).

    For each class k, its shuffled indices are cut among clients by proportions
    q_k ~ Dir(alpha * 1_N); the whole draw is repeated until every client holds at least
    ``min_samples`` (at most ``max_tries`` times). Every index goes to exactly one client.
    """
    _check_clients(num_clients)
    labels = np.asarray(labels).reshape(-1)
    n = len(labels)
    if alpha <= 0:
        raise ValueError(f"alpha (data.alpha) must be > 0, got {alpha}")
    if num_clients > n:
        raise PartitionError("data.num_clients", num_clients,
                             f"num_clients={num_clients} exceeds the {n} samples (every client needs at least one)")
    if min_samples * num_clients > n:
        raise PartitionError("data.min_samples", min_samples,
                             f"data.min_samples={min_samples} x num_clients={num_clients} exceeds the {n} samples")
    gen = as_rng(rng, _PURPOSE_DIRICHLET)
    classes = np.unique(labels)
    by_class = [np.nonzero(labels == k)[0] for k in classes]
    for _ in range(max_tries):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for idx in by_class:
            idx = gen.permutation(idx)
            q = gen.dirichlet(np.full(num_clients, float(alpha)))
            cuts = (np.cumsum(q) * len(idx)).astype(np.int64)[:-1]
            for c, piece in enumerate(np.split(idx, cuts)):
                parts[c].append(piece)
        clients = [np.sort(np.concatenate(p)).astype(np.int64) for p in parts]
        if min(len(c) for c in clients) >= min_samples:
            return clients
    raise PartitionError("data.alpha", alpha,
                         f"dirichlet partition: no draw in {max_tries} tries gave every one of {num_clients} clients "
                         f">= {min_samples} samples (data.alpha={alpha}); raise alpha or lower data.min_samples")


def iid_split(n: int, num_clients: int, rng: RngLike) -> list[np.ndarray]:
    """Uniformly random split of ``range(n)`` into near-equal parts (sizes differ by <= 1)."""
    _check_clients(num_clients)
    if n < num_clients:
        raise PartitionError("data.num_clients", num_clients,
                             f"iid split: {n} samples cannot give each of {num_clients} clients one")
    perm = as_rng(rng, _PURPOSE_IID).permutation(n)
    return [np.sort(p).astype(np.int64) for p in np.array_split(perm, num_clients)]


def natural_partition(natural: Mapping[str, np.ndarray], num_clients: int) -> list[tuple[str, np.ndarray]]:
    """The ``num_clients`` natural clients (e.g. Shakespeare roles) with most samples; ties by name.

    Deterministic (no randomness): papers/003 section 4.6 (docs/readings.md#dirichlet-and-natural-partitions) uses the
    20 roles with most lines. Output is ordered by decreasing size, then name.
    """
    _check_clients(num_clients)
    if len(natural) < num_clients:
        raise PartitionError("data.num_clients", num_clients,
                             f"natural partition: only {len(natural)} natural clients for num_clients={num_clients}")
    ranked = sorted(natural.items(), key=lambda kv: (-len(kv[1]), kv[0]))[:num_clients]
    return [(name, np.sort(np.asarray(idx, dtype=np.int64))) for name, idx in ranked]


def label_counts(labels: np.ndarray, num_classes: int) -> np.ndarray:
    """int64 [num_classes] histogram of ``labels`` (flattened, so per-token targets work too)."""
    y = np.asarray(labels).reshape(-1).astype(np.int64)
    if len(y) and (y.min() < 0 or y.max() >= num_classes):
        raise ValueError(f"labels outside [0, {num_classes}): min {y.min()}, max {y.max()}")
    return np.bincount(y, minlength=num_classes).astype(np.int64)


def tv_distance(p_counts: np.ndarray, q_counts: np.ndarray) -> float:
    """Total-variation distance 0.5 * sum_k |p_k/|p| - q_k/|q||, between two count vectors.

    The ground-truth heterogeneity of papers/003 section 4.4: a client's label
    distribution against the global label distribution of the pool it is drawn from.
    """
    p = np.asarray(p_counts, dtype=np.float64)
    q = np.asarray(q_counts, dtype=np.float64)
    if p.shape != q.shape or p.ndim != 1:
        raise ValueError(f"tv_distance needs two 1-D count vectors of equal length, got {p.shape} and {q.shape}")
    if (p < 0).any() or (q < 0).any() or p.sum() <= 0 or q.sum() <= 0:
        raise ValueError("tv_distance needs non-negative counts with a positive total")
    return float(0.5 * np.abs(p / p.sum() - q / q.sum()).sum())
