"""FedSAP Domain-Guided Assignment (DGA): pseudo-domain groups from shallow-gradient similarity.

papers/000 Eq. 4 and Appendix C "Domain-Guided Assignment (DGA)": after local training each
client reports the gradient of its first convolutional layer g_i; the server computes the
pairwise cosine similarity S_ij = <g_i, g_j> / (||g_i|| ||g_j||) (Eq. 4), thresholds it with
tau_sim = 0.5 and takes connected components as pseudo-domain groups; agglomerative
clustering on the distance 1 - S_ij is the stated alternative. The grouping is refreshed
every R_d = 5 rounds (the caller's schedule; nothing here keeps state).

Beyond the paper we add the options (docs/readings.md#dga) ``dga = gradient | none | oracle | random``:
``none`` puts every client in its own group, ``oracle`` uses the true domains, ``random``
draws random groups with exactly the group sizes of the gradient grouping (a matched
control). :func:`agreement` (adjusted Rand index) records whether a grouping recovered
the domains or merely the device-capacity tiers.

Group labels are always *canonical* (:func:`~fedsap_ray.algorithms.grouping.canonical_labels`): ``0..K-1``
numbered in order of first appearance by client index, so client 0 is in group 0 and equal
partitions give equal arrays.

Everything is pure numpy/scipy/sklearn and deterministic (``random`` only through the
``np.random.Generator`` it is given).
"""
from __future__ import annotations

from typing import Any
from collections.abc import Sequence

import numpy as np
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import connected_components

from fedsap_ray.algorithms.grouping import agreement, canonical_labels
from fedsap_ray.config.checks import check_choice, check_number

DGA_MODES = ("gradient", "none", "oracle", "random")
DGA_METHODS = ("components", "agglomerative")
DEFAULT_TAU_SIM = 0.5  # Appendix C

__all__ = ["DGA_MODES", "DGA_METHODS", "DEFAULT_TAU_SIM", "canonical_labels", "cosine_similarity_matrix",
           "groups_from_similarity", "oracle_groups", "singleton_groups", "random_groups_like",
           "assign_groups", "agreement", "n_groups"]


def cosine_similarity_matrix(grads: np.ndarray) -> np.ndarray:
    """Pairwise cosine similarity of client gradients, papers/000 Eq. 4 (Appendix C).

    ``grads`` has one row per client (``(n, d)``; any trailing shape is flattened, e.g. the
    raw ``(n, out, in, kh, kw)`` first-conv gradients). Returns the symmetric float64
    ``(n, n)`` matrix ``S_ij = <g_i, g_j> / (||g_i||_2 ||g_j||_2)``, clipped to [-1, 1],
    with ``S_ii = 1``.

    Zero gradients (a client that did not train the layer): Eq. 4 is 0/0 there; we define
    the similarity of a zero vector as 0 to every other client and 1 to itself, so such a
    client never joins a group at tau_sim > 0. Rows are rescaled by their max |entry|
    before normalising, so huge or tiny gradients neither overflow nor underflow.
    Non-finite gradients (a diverged client) raise ``ValueError`` naming the clients.
    """
    g = np.asarray(grads, dtype=np.float64)
    if g.ndim < 1:
        raise ValueError("grads must have one row per client, got a scalar")
    n = g.shape[0]
    g = g.reshape(n, -1)
    if n == 0:
        return np.zeros((0, 0), dtype=np.float64)
    bad = np.flatnonzero(~np.isfinite(g).all(axis=1))
    if bad.size:
        raise ValueError(f"non-finite gradient (NaN/inf) from client(s) {bad.tolist()}: "
                         "cannot compute Eq. 4 similarity")
    scale = np.abs(g).max(axis=1) if g.shape[1] else np.zeros(n)
    nonzero = scale > 0
    u = np.zeros_like(g)
    u[nonzero] = g[nonzero] / scale[nonzero, None]
    norms = np.linalg.norm(u, axis=1)
    u[nonzero] /= norms[nonzero, None]
    S = u @ u.T
    S = np.clip(0.5 * (S + S.T), -1.0, 1.0)
    np.fill_diagonal(S, 1.0)
    return S


def _check_tau(tau_sim: Any) -> float:
    check_number("algorithm.tau_sim", tau_sim, -1, 1)
    return float(tau_sim)


def _check_similarity(S: Any) -> np.ndarray:
    S = np.asarray(S, dtype=np.float64)
    if S.ndim != 2 or S.shape[0] != S.shape[1]:
        raise ValueError(f"similarity matrix must be square (n, n), got shape {S.shape}")
    if not np.isfinite(S).all():
        raise ValueError("similarity matrix has non-finite entries")
    if not np.allclose(S, S.T, rtol=0.0, atol=1e-8):
        raise ValueError("similarity matrix must be symmetric (Eq. 4 is)")
    return S


def groups_from_similarity(S: np.ndarray, tau_sim: float = DEFAULT_TAU_SIM,
                           method: str = "components") -> np.ndarray:
    """Pseudo-domain groups from the Eq. 4 similarity matrix (papers/000 Appendix C).

    ``method="components"`` (the paper's choice): an undirected graph with an edge i-j
    whenever ``S_ij >= tau_sim`` (inclusive: a pair exactly at the threshold IS joined;
    the diagonal is ignored); groups are its connected components
    (``scipy.sparse.csgraph.connected_components``). This is single linkage, so groups
    are transitive: i~j and j~k put i, j, k together even if S_ik < tau_sim.

    ``method="agglomerative"`` (Appendix C's alternative): sklearn
    ``AgglomerativeClustering(metric="precomputed", linkage="average",
    distance_threshold=1 - tau_sim, n_clusters=None)`` on ``D = clip(1 - S, 0, 2)``.
    sklearn merges only while the average-linkage distance is strictly *below* the
    threshold, so a pair exactly at ``S_ij = tau_sim`` is NOT merged (the opposite of the
    components rule at the boundary); away from the boundary and on well-separated
    clusters both methods agree.

    Returns canonical int64 labels (client 0 in group 0, ids in order of first appearance).
    """
    tau = _check_tau(tau_sim)
    S = _check_similarity(S)
    n = S.shape[0]
    check_choice("algorithm.dga_method", method, DGA_METHODS)
    if n <= 1:
        return np.zeros(n, dtype=np.int64)
    if method == "components":
        adj = S >= tau
        np.fill_diagonal(adj, False)
        _, labels = connected_components(csr_matrix(adj), directed=False)
        return canonical_labels(labels)
    from sklearn.cluster import AgglomerativeClustering  # late: keep module import light

    D = np.clip(1.0 - S, 0.0, 2.0)
    np.fill_diagonal(D, 0.0)
    model = AgglomerativeClustering(metric="precomputed", linkage="average",
                                    distance_threshold=1.0 - tau, n_clusters=None)
    return canonical_labels(model.fit_predict(D))


def oracle_groups(domains: Sequence[str]) -> np.ndarray:
    """``dga=oracle`` (docs/readings.md#dga): one group per true domain, canonical labels.

    The upper reference for Appendix C's DGA: what the gradient grouping would be if it
    recovered the domains exactly.
    """
    return canonical_labels(np.asarray([str(d) for d in domains], dtype=str))


def singleton_groups(n: int) -> np.ndarray:
    """``dga=none`` (docs/readings.md#dga): every client its own group, ``[0, 1, ..., n-1]``.

    With no pseudo-domain sharing, Private channels are not aggregated across clients
    (the "without DGA" ablation of papers/000 relative to Appendix C's grouping).
    """
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    return np.arange(int(n), dtype=np.int64)


def random_groups_like(reference: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``dga=random`` (docs/readings.md#dga): a matched control for Appendix C's grouping.

    Clients are randomly permuted and dealt into groups with exactly the multiset of group
    sizes of ``reference`` (normally the gradient grouping from Eq. 4), so any effect of
    DGA beyond "some groups of these sizes" shows up against this control. Deterministic
    for a given generator state; canonical labels. When every reference group has size 1
    (or there is one group) the result necessarily equals the reference.
    """
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng must be a numpy.random.Generator, got {type(rng).__name__}")
    ref = canonical_labels(reference)
    n = ref.size
    sizes = np.bincount(ref) if n else np.zeros(0, dtype=np.int64)
    perm = rng.permutation(n)
    out = np.empty(n, dtype=np.int64)
    start = 0
    for k, size in enumerate(sizes):
        out[perm[start:start + size]] = k
        start += size
    return canonical_labels(out)


def assign_groups(mode: str, *, grads: np.ndarray | None = None, domains: Sequence[str] | None = None,
                  reference: np.ndarray | None = None, rng: np.random.Generator | None = None,
                  tau_sim: float = DEFAULT_TAU_SIM, method: str = "components") -> np.ndarray:
    """Pseudo-domain groups for one DGA update round (Eq. 4, Appendix C; docs/readings.md#dga).

    - ``gradient``: needs ``grads`` (one row per client, the first-layer gradient);
      Eq. 4 similarity, then :func:`groups_from_similarity` with ``tau_sim``/``method``.
    - ``none``: singleton groups; needs the client count from ``grads``, ``domains`` or
      ``reference``.
    - ``oracle``: needs ``domains`` (true domain name per client).
    - ``random``: needs ``rng`` and either ``reference`` (the gradient grouping to match)
      or ``grads`` (the gradient grouping is computed first, then matched).

    Returns canonical int64 labels. Unknown modes or missing inputs raise ``ValueError``
    (``ConfigError`` for bad config values) naming the field.
    """
    check_choice("algorithm.dga", mode, DGA_MODES)
    if mode == "gradient":
        if grads is None:
            raise ValueError("algorithm.dga='gradient' needs grads (first-layer gradient per client)")
        return groups_from_similarity(cosine_similarity_matrix(grads), tau_sim=tau_sim, method=method)
    if mode == "oracle":
        if domains is None:
            raise ValueError("algorithm.dga='oracle' needs domains (true domain name per client)")
        return oracle_groups(domains)
    if mode == "none":
        for src in (grads, domains, reference):
            if src is not None:
                return singleton_groups(len(src))
        raise ValueError("algorithm.dga='none' needs grads, domains or reference to know the client count")
    # random
    if rng is None:
        raise ValueError("algorithm.dga='random' needs rng (a numpy.random.Generator)")
    if reference is None:
        if grads is None:
            raise ValueError("algorithm.dga='random' needs reference (the gradient grouping) or grads")
        reference = groups_from_similarity(cosine_similarity_matrix(grads), tau_sim=tau_sim, method=method)
    return random_groups_like(reference, rng)


def n_groups(groups: Sequence[Any] | np.ndarray) -> int:
    """Number of distinct groups K in a grouping (Appendix C's K)."""
    return int(np.unique(np.asarray(groups)).size)
