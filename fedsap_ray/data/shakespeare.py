"""Shakespeare next-character prediction, naturally partitioned by speaking role.

One domain (``shakespeare``); every sample is 80 characters ``x`` (int64 [N, 80]) and
the next character ``y``. Vocabulary: the 95 printable ASCII characters, code
32..126 -> id 0..94 (so space is 0). Anything else -- newline, tab, non-ASCII
letters -- becomes a space, and runs of spaces collapse to one, as LEAF's preprocessing
does (``txt.replace('\\n', ' ')`` then squeezing spaces), so texts from every reader
look alike.

Readers, first found under ``root`` (or ``root/shakespeare``) wins:

1. LEAF json (clusters): ``data/train/*.json`` + ``data/test/*.json``, or only
   ``all_data/*.json`` (then each user's first 80% of samples are train, the rest test,
   in file order). Samples are used as LEAF made them (stride-1 windows).
2. TFF/LEAF HDF5 (the shared files): ``fedshakespeare_{train,test}.h5`` (or TFF's
   ``shakespeare_{train,test}.h5``), ``examples/<PLAY_ROLE>/snippets``. A client's
   snippets are joined into one text and cut into 80-char windows every ``stride``
   characters (default 8; LEAF uses 1). The stride bounds memory and load time -- the
   shared train file has 2.36 M characters, i.e. ~2.3 M stride-1 windows (1.5 GB of
   int64) but ~0.29 M at stride 8 (every 8th character of a text is a target).
3. Raw play text ``tinyshakespeare_input.txt``: blocks separated by blank lines whose
   first line is ``NAME:``; each role's speech is joined, its first 80% of characters
   is train text and the rest test text, windows as in 2.

``natural_train``/``natural_test`` map each role with at least one training window to
its indices in ``train``/``test`` (a role's test list may be empty); test rows of roles
without any training window are dropped, so the maps cover both sets exactly.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fedsap_ray.data.base import DomainData
from fedsap_ray.data.registry import DomainSplits, FileStatus, register_dataset
from fedsap_ray.data.status import default_root, unavailable

SEQ_LEN = 80
VOCAB_SIZE = 95
TRAIN_FRACTION = 0.8


def encode(text: str, squeeze_spaces: bool = True) -> np.ndarray:
    """Text -> int64 ids 0..94 (printable ASCII 32..126; anything else -> space, runs of spaces -> one)."""
    cp = np.frombuffer(text.encode("utf-32-le"), dtype="<u4").astype(np.int64)
    ids = np.where((cp >= 32) & (cp <= 126), cp - 32, 0)
    if squeeze_spaces and len(ids) > 1:
        keep = np.ones(len(ids), bool)
        keep[1:] = ~((ids[1:] == 0) & (ids[:-1] == 0))
        ids = ids[keep]
    return ids


def decode(ids: np.ndarray | torch.Tensor) -> str:
    """int ids -> text (inverse of :func:`encode` on printable ASCII)."""
    return "".join(chr(int(i) + 32) for i in np.asarray(ids).ravel())


@dataclass
class WindowSet:
    """All clients' samples, concatenated in client order; ``own_*`` = client index of each row (non-decreasing)."""

    names: list[str]
    x_train: np.ndarray
    y_train: np.ndarray
    own_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    own_test: np.ndarray


def windows(texts: list[np.ndarray], stride: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(80-char window -> next char) pairs from each id text, starting every ``stride`` characters.

    Returns (x int64 [N, 80], y int64 [N], owner int64 [N] = index of the source text).
    Rows are copied out of one sliding-window view of the concatenated texts (no index matrix).
    """
    if stride < 1:
        raise ValueError(f"stride must be >= 1, got {stride}")
    lengths = np.array([len(t) for t in texts], np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) if len(texts) else np.zeros(0, np.int64)
    starts: list[np.ndarray] = []
    owners: list[np.ndarray] = []
    for k, (off, n) in enumerate(zip(offsets, lengths)):
        st = np.arange(0, max(n - SEQ_LEN, 0), stride, dtype=np.int64)  # need start + 80 < n for the target
        starts.append(off + st)
        owners.append(np.full(len(st), k, np.int64))
    g = np.concatenate(starts) if starts else np.zeros(0, np.int64)
    owner = np.concatenate(owners) if owners else np.zeros(0, np.int64)
    if not len(g):
        return np.zeros((0, SEQ_LEN), np.int64), np.zeros(0, np.int64), owner
    flat = np.concatenate(texts).astype(np.int64, copy=False)
    x = np.lib.stride_tricks.sliding_window_view(flat, SEQ_LEN)[g]
    return x, flat[g + SEQ_LEN], owner


def windowed_clients(texts: dict[str, tuple[np.ndarray, np.ndarray]], stride: int) -> WindowSet:
    """Per-client (train ids, test ids) texts -> one :class:`WindowSet`, one vectorised pass per split."""
    names = list(texts)
    xtr, ytr, otr = windows([texts[n][0] for n in names], stride)
    xte, yte, ote = windows([texts[n][1] for n in names], stride)
    return WindowSet(names, xtr, ytr, otr, xte, yte, ote)


# ----------------------------------------------------------------------------- readers
def read_fedshakespeare_h5(train_path: Path, test_path: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """TFF/LEAF HDF5 pair -> {client: (train ids, test ids)}; a client's snippets are joined by newlines."""
    import h5py

    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    texts: dict[str, list[np.ndarray]] = {}
    for path in (train_path, test_path):
        with h5py.File(path, "r") as f:
            if "examples" not in f:
                raise ValueError(f"{path}: no 'examples' group (expected examples/<CLIENT>/snippets)")
            ex = f["examples"]
            for client in ex:
                snippets = ex[client]["snippets"][()]
                text = "\n".join(s.decode("utf-8", errors="replace") if isinstance(s, bytes) else str(s) for s in np.atleast_1d(snippets))
                texts.setdefault(client, []).append(encode(text))
    empty = np.zeros(0, np.int64)
    for client, parts in texts.items():
        out[client] = (parts[0], parts[1] if len(parts) > 1 else empty)
    return out


_ROLE_LINE = re.compile(r"^([A-Za-z][A-Za-z '.\-]*):\s*$")


def parse_roles(text: str) -> dict[str, str]:
    """Play text with ``NAME:`` speaker blocks (separated by blank lines) -> {role: joined speech}, in order of appearance."""
    roles: dict[str, list[str]] = {}
    for block in re.split(r"\n[ \t]*\n", text.replace("\r\n", "\n")):
        lines = block.strip("\n").split("\n")
        m = _ROLE_LINE.match(lines[0].strip())
        if m is None or len(lines) < 2:
            continue
        roles.setdefault(m.group(1).strip(), []).append("\n".join(lines[1:]))
    return {r: "\n".join(parts) for r, parts in roles.items()}


def read_play_text(path: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Raw play text -> {role: (first 80% of its characters, the rest)}."""
    roles = parse_roles(path.read_text(encoding="utf-8", errors="replace"))
    out = {}
    for role, speech in roles.items():
        ids = encode(speech)
        cut = int(len(ids) * TRAIN_FRACTION)
        out[role] = (ids[:cut], ids[cut:])
    return out


def _leaf_users(files: list[Path]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """LEAF json files -> {user: (x [n, 80], y [n])}, users merged across files in file order."""
    out: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    for path in files:
        with open(path, encoding="utf-8") as f:
            blob = json.load(f)
        for user in blob["users"]:
            d = blob["user_data"][user]
            xs, ys = d["x"], d["y"]
            if len(xs) != len(ys):
                raise ValueError(f"{path}: user {user!r} has {len(xs)} inputs but {len(ys)} targets")
            bad = next((s for s in xs if len(s) != SEQ_LEN), None)
            if bad is not None:
                raise ValueError(f"{path}: user {user!r} has an input of {len(bad)} characters, expected {SEQ_LEN}")
            if any(len(c) != 1 for c in ys):
                raise ValueError(f"{path}: user {user!r} has a target that is not one character")
            x = encode("".join(xs), squeeze_spaces=False).reshape(len(xs), SEQ_LEN)
            y = encode("".join(ys), squeeze_spaces=False)
            out.setdefault(user, []).append((x, y))
    return {u: (np.concatenate([p[0] for p in v]), np.concatenate([p[1] for p in v])) for u, v in out.items()}


def read_leaf(train_files: list[Path], test_files: list[Path]) -> WindowSet:
    """LEAF json, either a train/test pair of folders or only all_data (then a per-user 80/20 split in order)."""
    empty_x, empty_y = np.zeros((0, SEQ_LEN), np.int64), np.zeros(0, np.int64)
    train = _leaf_users(train_files)
    test = _leaf_users(test_files) if test_files else None
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
    for u, (x, y) in train.items():
        if test is not None:
            parts.append((x, y, *test.get(u, (empty_x, empty_y))))
        else:
            c = int(round(len(y) * TRAIN_FRACTION))
            parts.append((x[:c], y[:c], x[c:], y[c:]))
    own = lambda k: np.repeat(np.arange(len(parts), dtype=np.int64), [len(p[k]) for p in parts])  # noqa: E731
    cat = lambda k, empty: np.concatenate([p[k] for p in parts]) if parts else empty  # noqa: E731
    return WindowSet(list(train), cat(0, empty_x), cat(1, empty_y), own(1), cat(2, empty_x), cat(3, empty_y), own(3))


# ----------------------------------------------------------------------------- source
def find_layout(root: Path) -> tuple[str, list[Path]] | None:
    """The first available reader under ``root`` or ``root/shakespeare``: (kind, its files)."""
    for base in (root, root / "shakespeare"):
        tr, te = sorted((base / "data" / "train").glob("*.json")), sorted((base / "data" / "test").glob("*.json"))
        if tr and te:
            return "leaf", [base / "data" / "train", base / "data" / "test"]
        if sorted((base / "all_data").glob("*.json")):
            return "leaf_all", [base / "all_data"]
        for prefix in ("fedshakespeare", "shakespeare"):
            pair = [base / f"{prefix}_train.h5", base / f"{prefix}_test.h5"]
            if all(p.is_file() for p in pair):
                return "h5", pair
        if (base / "tinyshakespeare_input.txt").is_file():
            return "text", [base / "tinyshakespeare_input.txt"]
    return None


@register_dataset("shakespeare", single_domain=True, natural_partition=True, inputs=("text",))
class ShakespeareSource:
    """Federated Shakespeare: one client per speaking role, next-character prediction."""

    name: str
    description = "Shakespeare: next character from 80, 95-symbol vocabulary, one client per speaking role"
    how_to_obtain = (
        "run LEAF's data/shakespeare/preprocess.sh and set data.root to leaf/data/shakespeare (data/train, data/test), "
        "or place fedshakespeare_{train,test}.h5 or a play text tinyshakespeare_input.txt in <root>"
    )
    stride = 8

    def default_root(self) -> Path:
        return default_root(self.name, self.files)  # one rule for every loader (data/status.py)

    def files(self, root: Path) -> list[FileStatus]:
        root = Path(root).expanduser()
        found = find_layout(root)
        if found is None:
            return [FileStatus("LEAF json (train)", root / "data" / "train", False),
                    FileStatus("LEAF json (test)", root / "data" / "test", False)]
        kind, paths = found
        return [FileStatus(f"Shakespeare {kind}: {p.name}", p, True) for p in paths]

    def load(self, root: Path, *, download: bool, seed: int) -> DomainSplits:
        """Read the first layout found (``download``/``seed`` unused: LEAF data is made by LEAF's scripts)."""
        root = Path(root).expanduser()
        found = find_layout(root)
        if found is None:
            raise unavailable(
                self.name,
                [
                    (
                        "LEAF json",
                        root / "data" / "train",
                        f"nor {root / 'shakespeare' / 'fedshakespeare_train.h5'} or {root / 'tinyshakespeare_input.txt'}; "
                        "no automatic download: run LEAF's data/shakespeare/preprocess.sh and set data.root to leaf/data/shakespeare",
                    )
                ],
            )
        kind, paths = found
        if kind == "leaf":
            clients = read_leaf(sorted(paths[0].glob("*.json")), sorted(paths[1].glob("*.json")))
            how = f"LEAF json ({paths[0].parent}), stride-1 windows as LEAF made them"
        elif kind == "leaf_all":
            clients = read_leaf(sorted(paths[0].glob("*.json")), [])
            how = f"LEAF all_data json ({paths[0]}), each user's first 80% of samples train"
        elif kind == "h5":
            clients = windowed_clients(read_fedshakespeare_h5(paths[0], paths[1]), self.stride)
            how = f"TFF/LEAF HDF5 ({paths[0].parent}), one client per (play, role), windows every {self.stride} characters"
        else:
            clients = windowed_clients(read_play_text(paths[0]), self.stride)
            how = (f"play text {paths[0].name} split by speaking role (first 80% of each role's characters train), "
                   f"windows every {self.stride} characters")
        return build_splits(self.name, clients, how)


def build_splits(dataset: str, ws: WindowSet, how: str) -> DomainSplits:
    """One domain with natural index maps over the clients that have >= 1 training window.

    Test rows of clients without training windows are dropped, so the natural maps cover
    both sets exactly.
    """
    n = len(ws.names)
    kept = np.bincount(ws.own_train, minlength=n) > 0
    if not kept.any():
        raise ValueError(f"{dataset}: no client has a text longer than {SEQ_LEN} characters ({how})")
    x_test, y_test, own_test = ws.x_test, ws.y_test, ws.own_test
    if not kept[own_test].all():
        m = kept[own_test]
        x_test, y_test, own_test = x_test[m], y_test[m], own_test[m]
    btr = np.searchsorted(ws.own_train, np.arange(n + 1))
    bte = np.searchsorted(own_test, np.arange(n + 1))
    natural_train = {ws.names[k]: np.arange(btr[k], btr[k + 1], dtype=np.int64) for k in range(n) if kept[k]}
    natural_test = {ws.names[k]: np.arange(bte[k], bte[k + 1], dtype=np.int64) for k in range(n) if kept[k]}
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))  # noqa: E731
    train = DomainData(t(ws.x_train), t(ws.y_train))
    test = DomainData(t(x_test), t(y_test))
    for part, d in (("train", train), ("test", test)):
        if len(d) and (int(d.x.min()) < 0 or int(d.x.max()) >= VOCAB_SIZE or int(d.y.min()) < 0 or int(d.y.max()) >= VOCAB_SIZE):
            raise ValueError(f"{dataset}: {part} ids outside 0..{VOCAB_SIZE - 1}")
    return DomainSplits(
        dataset=dataset,
        domains=["shakespeare"],
        train={"shakespeare": train},
        test={"shakespeare": test},
        num_classes=VOCAB_SIZE,
        input_kind="text",
        input_shape=(SEQ_LEN,),
        vocab_size=VOCAB_SIZE,
        notes=f"Shakespeare (real text): {how}; 95 printable-ASCII ids, other characters -> space",
        domain_notes={"shakespeare": f"{int(kept.sum())} roles, {len(train)} train / {len(test)} test windows"},
        natural_train=natural_train,
        natural_test=natural_test,
    )
