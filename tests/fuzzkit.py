"""Hypothesis strategies of the fuzz harness (tests/results/test_folder_fuzz.py): tampering actions on a results
folder, and config documents (duplicate keys, null and empty sections, anchors and aliases).

A tampering action is plain data (:class:`Act`), printed by Hypothesis as a falsifying example; it picks
its target among the folder's real entries *when it is applied* (``pick`` modulo their number, in sorted
order), so a shrunk example names a real entry and :func:`apply` returns a line per action saying what it
did (the reproduction a failure message quotes).
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from hypothesis import strategies as st

from fedsap_ray.persist import treecodec
from fedsap_ray.config import MAX_YAML_NODES

# ----------------------------------------------------------------------------------------- folders


def snapshot(root: Path) -> dict[str, object]:
    """Every entry under ``root``: a file's bytes, a link's target, a folder's mark (links never followed)."""
    out: dict[str, object] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_dir():
                out[rel] = "dir"
            elif p.is_file():
                out[rel] = p.read_bytes()
            else:
                out[rel] = "special"
    return out


def entries(root: Path, kind: str) -> list[str]:
    """Relative paths of the real entries under ``root`` of ``kind`` ("file", "dir" or "any"), sorted;
    links are entries but never followed."""
    found = []
    for rel, v in sorted(snapshot(root).items()):
        is_dir = v == "dir"
        is_file = isinstance(v, bytes)
        if kind == "any" or (kind == "dir" and is_dir) or (kind == "file" and is_file):
            found.append(rel)
    return found


@dataclass(frozen=True)
class Act:
    """One tampering action: ``kind`` (see :data:`KINDS`), ``pick`` (chooses the target), ``arg`` (its detail)."""

    kind: str
    pick: int = 0
    arg: Any = None


#: checkpoint edits: field -> the variants an ``Act("checkpoint", ...)`` chooses from (its ``arg``)
CKPT_EDITS: dict[str, list[Any]] = {
    "params": ["short", "long", "nan", "inf", "float64", "int32", "str", "2d", "empty", "list", "scalar"],
    "strategy": ["drop", "add", "str", "strarr", "nested", "float64", "badkey", "negkey", "strkey", "shortarr",
                 "not-a-dict", "2d"],
    "server": ["drop", "str", "int", "list", "nested", "dropinner", "innerstr", "domainfloat", "domainshort",
               "not-a-dict"],
    "tables": [[1], ["nope"], [], ["rounds"], ["rounds", "clients", "layers"], "rounds",
               ["rounds", "rounds", "clients"], [None], [["rounds"]]],
    "rows": ["drop", "negative", "extra-round", "missing-round", "off-by-one", "unknown-table", "strkey",
             "list", "float", "huge"],
}
ROUNDS = st.one_of(st.integers(-3, 4), st.sampled_from([2**31, 2**63 - 1, -(2**63), 10**30]),
                   st.sampled_from(["1", 1.0, None, True, [1], {"r": 1}]))

_ARGS = {
    "link": st.sampled_from(["file", "folder", "copy"]),
    "truncate": st.integers(0, 2**20),
    "flip": st.lists(st.tuples(st.integers(0, 2**20), st.integers(1, 255)), min_size=1, max_size=4).map(tuple),
    "delete": st.none(), "fifo": st.none(), "dir-for-file": st.none(), "file-for-dir": st.none(),
    "stale-checkpoint": st.none(),
    "round": ROUNDS,
    "checkpoint": st.sampled_from([(f, i) for f in sorted(CKPT_EDITS) for i in range(len(CKPT_EDITS[f]))]),
}
KINDS = tuple(_ARGS)
# the kind first, uniformly (checkpoint edits, with the most variants, twice as often), then its target and detail
acts = st.sampled_from([*KINDS, "checkpoint"]).flatmap(
    lambda kind: st.builds(Act, st.just(kind), st.integers(0, 999), _ARGS[kind]))


def _pick(items: list[str], i: int) -> str | None:
    return items[i % len(items)] if items else None


def apply(act: Act, out: Path, outside: Path, run_id: str) -> str:
    """Do ``act`` to the results folder ``out`` (links point into ``outside``); ``run_id``: the run whose
    checkpoint the checkpoint edits change. Returns what was done, one line ("skipped ..." when the
    folder has no entry the action applies to)."""
    if act.kind == "link":
        rel = _pick(entries(out, "any"), act.pick)
        if rel is None:
            return "link: no entry"
        p = out / rel
        was_dir = p.is_dir() and not p.is_symlink()
        if act.arg == "copy":  # a faithful copy outside: looks valid, must still never be written through
            target = outside / "copies" / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            if was_dir:
                shutil.copytree(p, target, symlinks=True)
            elif p.is_file() and not p.is_symlink():
                shutil.copy2(p, target)
            else:
                target = outside / "file"
        else:
            target = outside / act.arg
        _remove(p)
        p.symlink_to(target, target_is_directory=target.is_dir())
        return f"link {rel} -> {target.relative_to(outside)}"
    if act.kind in ("truncate", "flip", "delete", "fifo", "dir-for-file"):
        rel = _pick(entries(out, "file"), act.pick)
        if rel is None:
            return f"{act.kind}: no file"
        p = out / rel
        if act.kind == "truncate":
            data = p.read_bytes()
            n = act.arg % max(len(data), 1)
            p.write_bytes(data[:n])
            return f"truncate {rel} to {n} of {len(data)} bytes"
        if act.kind == "flip":
            data = bytearray(p.read_bytes())
            if not data:
                return f"flip {rel}: empty"
            done = []
            for pos, mask in act.arg:
                data[pos % len(data)] ^= mask
                done.append(f"{pos % len(data)}^{mask}")
            p.write_bytes(bytes(data))
            return f"flip {rel} at {', '.join(done)}"
        p.unlink()
        if act.kind == "fifo":
            os.mkfifo(p)
        elif act.kind == "dir-for-file":
            p.mkdir()
            (p / "x").write_bytes(b"x")
        return f"{act.kind} {rel}"
    if act.kind == "file-for-dir":
        rel = _pick(entries(out, "dir"), act.pick)
        if rel is None:
            return "file-for-dir: no folder"
        shutil.rmtree(out / rel)
        (out / rel).write_bytes(b"not a folder\n")
        return f"file-for-dir {rel}"
    if act.kind == "stale-checkpoint":  # the checkpoint of a run that finished (killed before removing it)
        src, dst = out / "checkpoints" / f"{run_id}.npz", out / "checkpoints" / "done.npz"
        if not _plain_file(src) or not (out / "checkpoints").is_dir() or (out / "checkpoints").is_symlink():
            return "stale-checkpoint: no checkpoint"
        header, tree = treecodec.read(src) if _readable(src) else ({}, None)
        if tree is None:
            shutil.copy(src, dst)
            return "stale-checkpoint: copied an unreadable checkpoint to done.npz"
        _write_tree(dst, {**header, "run_id": "done"}, tree)
        return "stale-checkpoint: done.npz = the checkpoint of " + run_id
    if act.kind in ("round", "checkpoint"):
        p = out / "checkpoints" / f"{run_id}.npz"
        if not _plain_file(p) or not _readable(p):
            return f"{act.kind}: no readable checkpoint"
        header, tree = treecodec.read(p)
        if act.kind == "round":
            tree["state"]["round"] = act.arg
            if type(act.arg) is int:
                header["round"] = act.arg
            how = f"round = {act.arg!r}"
        else:
            field, i = act.arg
            variant = CKPT_EDITS[field][i]
            try:
                how = f"{field}: {variant!r}: " + _edit(tree, field, variant, act.pick)
            except (AttributeError, IndexError, KeyError, TypeError, ValueError):
                # an earlier action already changed the field's shape (e.g. strategy made a list): nothing to edit
                return f"checkpoint {field}: {variant!r}: not applicable after an earlier edit"
        _write_tree(p, header, tree)
        return f"checkpoint {how}"
    raise AssertionError(act.kind)


def _plain_file(p: Path) -> bool:
    return p.is_file() and not p.is_symlink() and not any(q.is_symlink() for q in p.parents)


def _readable(p: Path) -> bool:
    try:
        treecodec.read(p)
        return True
    except treecodec.TreeFormatError:
        return False


def _write_tree(p: Path, header: dict, tree: Any) -> None:
    """Write a checkpoint at ``p``; an entry there that is not a plain file (a FIFO, a link, a folder an earlier
    action put there) is replaced, never opened: opening a FIFO would wait for a writer forever."""
    header = {k: v for k, v in header.items() if k not in ("format", "version")}
    if p.is_symlink() or (p.exists() and not p.is_file()):
        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    with open(p, "wb") as f:
        treecodec.write(f, tree, header=header)


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    else:
        p.unlink()


def _edit(tree: dict, field: str, variant: Any, pick: int) -> str:
    """Change one field of a checkpoint tree in place; returns the detail (which key)."""
    st_ = tree["state"]
    if field == "params":
        p = st_["params"]
        st_["params"] = {
            "short": lambda: p[:-1], "long": lambda: np.concatenate([p, p[:1]]),
            "nan": lambda: np.where(np.arange(p.size) == pick % p.size, np.float32("nan"), p).astype(np.float32),
            "inf": lambda: np.where(np.arange(p.size) == pick % p.size, np.float32("-inf"), p).astype(np.float32),
            "float64": lambda: p.astype(np.float64), "int32": lambda: p.astype(np.int32),
            "str": lambda: np.array(["0"] * p.size), "2d": lambda: p.reshape(1, -1), "empty": lambda: p[:0],
            "list": lambda: [float(x) for x in p[:10]], "scalar": lambda: float(p[0]),
        }[variant]()
        return ""
    if field == "tables":
        tree["tables"] = variant
        return ""
    if field == "rows":
        rows = tree.get("rows")
        if rows is None:
            return "no rows"
        t = sorted(rows)[pick % len(rows)]
        counts = rows[t]
        last = max(counts) if counts else 0
        if variant == "drop":
            del tree["rows"]
        elif variant == "negative":
            counts[last] = -1
        elif variant == "extra-round":
            counts[last + 1] = counts.get(last, 1)
        elif variant == "missing-round":
            counts.pop(last, None)
        elif variant == "off-by-one":
            counts[last] = counts.get(last, 0) + 1
        elif variant == "unknown-table":
            rows["nope"] = {1: 1}
        elif variant == "strkey":
            rows[t] = {str(k): v for k, v in counts.items()}
        elif variant == "list":
            rows[t] = list(counts.values())
        elif variant == "float":
            rows[t] = {k: float(v) + 0.5 for k, v in counts.items()}
        elif variant == "huge":
            counts[last] = 2**62
        return t
    if field == "strategy":
        s = st_["strategy"]
        keys = sorted(s, key=str)
        k = keys[pick % len(keys)] if keys else "c"
        arr_keys = [key for key in keys if isinstance(s[key], np.ndarray)]
        dict_keys = [key for key in keys if isinstance(s[key], dict) and s[key]]
        if variant == "drop":
            s.pop(k, None)
        elif variant == "add":
            s[f"bogus{pick % 3}"] = np.zeros(3, np.float32)
        elif variant == "str":
            s[k] = "x"
        elif variant == "strarr":
            s[k] = np.array(["a", "b"])
        elif variant == "nested":
            s[k] = {"a": {"b": [1, 2]}}
        elif variant == "float64" and arr_keys:
            k = arr_keys[pick % len(arr_keys)]
            s[k] = s[k].astype(np.float64)
        elif variant == "2d" and arr_keys:
            k = arr_keys[pick % len(arr_keys)]
            s[k] = s[k].reshape(1, -1)
        elif variant in ("badkey", "negkey", "strkey", "shortarr") and dict_keys:
            k = dict_keys[pick % len(dict_keys)]
            d = s[k]
            first = sorted(d, key=str)[0]
            if variant == "badkey":
                d[10**6] = d[first]
            elif variant == "negkey":
                d[-1] = d.pop(first)
            elif variant == "strkey":
                d[str(first)] = d.pop(first)
            else:
                d[first] = d[first][:-1] if isinstance(d[first], np.ndarray) else "x"
        elif variant == "not-a-dict":
            st_["strategy"] = [1, 2]
        else:
            return "(no such field: unchanged)"
        return str(k)
    if field == "server":
        m = tree["server"]
        keys = sorted(m)
        k = keys[pick % len(keys)] if keys else "best_by_mode"
        if variant == "drop":
            m.pop(k, None)
        elif variant == "str":
            m[k] = "x"
        elif variant == "int":
            m[k] = 7
        elif variant == "list":
            m[k] = [1, 2]
        elif variant == "nested":
            m[k] = {"a": {"b": 1}}
        elif variant in ("dropinner", "innerstr"):
            inner = [key for key in keys if isinstance(m[key], dict) and m[key]]
            if not inner:
                return "(no inner mapping: unchanged)"
            k = inner[pick % len(inner)]
            ik = sorted(m[k])[pick % len(m[k])]
            if variant == "dropinner":
                del m[k][ik]
            else:
                m[k][ik] = "x"
            k = f"{k}.{ik}"
        elif variant in ("domainfloat", "domainshort"):
            cov = m.get("domain_covered")
            if not isinstance(cov, dict) or not cov:
                return "(no domain_covered: unchanged)"
            dk = sorted(cov)[pick % len(cov)]
            cov[dk] = cov[dk].astype(np.float32) if variant == "domainfloat" else cov[dk][:5]
            k = f"domain_covered.{dk}"
        elif variant == "not-a-dict":
            tree["server"] = [m]
        return str(k)
    raise AssertionError(field)


# ------------------------------------------------------------------------------------------ configs
# Fields a document may set, each with values that are legal on the smoke preset (the printed config
# must then hold exactly them), and int fields that may share one anchored value.
LEGAL: dict[tuple[str, ...], list[Any]] = {
    ("training", "rounds"): [1, 2, 3],
    ("training", "local_epochs"): [1, 2],
    ("training", "lr"): [0.05, 0.1],
    ("training", "max_steps_per_epoch"): [2, 3, None],
    ("data", "num_clients"): [4, 6],
    ("data", "alpha"): [0.3, 1.0],
    ("model", "width_mult"): [0.25, 0.5],
    ("devices", "jitter"): [0.0, 0.1],
    ("devices", "policy"): ["wait_all"],
    ("capacity", "scheme"): ["tiers"],
    ("seed",): [0, 7, 123],
    ("study",): ["fz"],
}
SHAREABLE = [("training", "rounds"), ("training", "local_epochs"), ("training", "max_steps_per_epoch")]
SECTIONS = ("data", "capacity", "model", "training", "devices", "resources", "algorithm")


@dataclass(frozen=True)
class Doc:
    """A config document as text, what it must do (``refuse``: why it must exit 2, or None), and the
    values the printed config must hold when it is accepted."""

    text: str
    suffix: str
    refuse: tuple[str, ...]  # each a part of a line that refuses it (the first problem met is named)
    expect: tuple[tuple[tuple[str, ...], Any], ...]


def _scalar(v: Any) -> str:
    return json.dumps(v)  # JSON scalars are YAML scalars (null, true, 1, 0.05, "x")


def _render_yaml(tree: list, indent: int = 0) -> list[str]:
    """Block YAML of ``tree``: a list of (key, node); a node is ("leaf", text), ("map", tree),
    ("null", form), ("text", raw YAML after the key)."""
    lines = []
    pad = "  " * indent
    for key, node in tree:
        tag, v = node
        if tag == "map":
            if v:
                lines.append(f"{pad}{key}:")
                lines.extend(_render_yaml(v, indent + 1))
            else:
                lines.append(f"{pad}{key}: {{}}")
        elif tag == "null":
            lines.append(f"{pad}{key}:{v}")
        else:  # leaf or raw text
            lines.append(f"{pad}{key}: {v}")
    return lines


def _render_json(tree: list) -> str:
    parts = []
    for key, (tag, v) in tree:
        val = ("{" + _render_json(v) + "}") if tag == "map" else ("null" if tag == "null" else v)
        parts.append(f"{json.dumps(key)}: {val}")
    return ", ".join(parts)


@st.composite
def config_docs(draw) -> Doc:
    """A legal document of a few known fields, then 0-3 changes: a duplicate key (top level or in a
    section), a null section, an empty section, an anchored value shared by two fields, an anchored
    mapping merged (``<<``) into a section, an alias bomb (nested lists of aliases, sized to stay under
    or go over the loader's limit) at the top level, under an unknown key or a field; YAML or JSON."""
    chosen = draw(st.lists(st.sampled_from(sorted(LEGAL)), min_size=0, max_size=5, unique=True))
    values = {path: draw(st.sampled_from(LEGAL[path])) for path in chosen}
    tree: list = []
    sec_of: dict[str, list] = {}
    for path, v in values.items():
        if len(path) == 1:
            tree.append((path[0], ("leaf", _scalar(v))))
        else:
            if path[0] not in sec_of:
                sec_of[path[0]] = []
                tree.append((path[0], ("map", sec_of[path[0]])))
            sec_of[path[0]].append((path[1], ("leaf", _scalar(v))))
    expect = dict(values)
    refuse: list[str] = []
    suffix = draw(st.sampled_from([".yaml", ".yaml", ".json"]))
    changes = draw(st.lists(st.sampled_from(["dup-top", "dup-section", "null", "empty", "share", "merge", "bomb"]),
                            max_size=3))
    yaml_only = False
    for change in changes:
        if change == "dup-top" and tree:
            i = draw(st.integers(0, len(tree) - 1))
            tree.append(tree[i])  # the same key again, last: YAML would let it win silently
            refuse.append(f"duplicate key {tree[i][0]}")
        elif change == "dup-section":
            maps = [(k, v) for k, (tag, v) in tree if tag == "map" and v]
            if maps:
                k, sec = maps[draw(st.integers(0, len(maps) - 1))]
                j = draw(st.integers(0, len(sec) - 1))
                field, _ = sec[j]
                other = draw(st.sampled_from(LEGAL[(k, field)]))
                sec.insert(draw(st.integers(0, len(sec))), (field, ("leaf", _scalar(other))))
                refuse.append(f"duplicate key {k}.{field}")
        elif change == "null":
            free = [s for s in SECTIONS if s not in sec_of]
            if not free:
                continue
            sec = draw(st.sampled_from(free))
            tree.insert(draw(st.integers(0, len(tree))), (sec, ("null", draw(st.sampled_from(["", " null", " ~"])))))
            sec_of[sec] = []
            refuse.append(f"invalid {sec}=null")
        elif change == "empty":
            free = [s for s in SECTIONS if s not in sec_of]
            if free:
                sec = draw(st.sampled_from(free))
                sec_of[sec] = []
                tree.insert(draw(st.integers(0, len(tree))), (sec, ("map", sec_of[sec])))
        elif change == "share":  # one anchored int shared by two fields: legal, both get it
            a, b = draw(st.lists(st.sampled_from(SHAREABLE), min_size=2, max_size=2, unique=True))
            if any(p in expect for p in (a, b)) or any(s in sec_of and not _is_map(tree, s) for s in (a[0], b[0])):
                continue
            v = draw(st.sampled_from([2, 3]))
            for path, text in ((a, f"&v{len(tree)} {v}"), (b, f"*v{len(tree)}")):
                if path[0] not in sec_of:
                    sec_of[path[0]] = []
                    tree.append((path[0], ("map", sec_of[path[0]])))
                sec_of[path[0]].append((path[1], ("leaf", text)))
                expect[path] = v
            yaml_only = True
        elif change == "merge":  # an anchored section merged (<<) into a mapping under an unknown key
            if "training" in sec_of:
                continue
            rounds, lr, over = draw(st.sampled_from([1, 2])), draw(st.sampled_from([0.05, 0.1])), draw(st.booleans())
            tree.append(("training", ("text", f"&tr {{rounds: {rounds}, lr: {lr}}}")))
            sec_of["training"] = []
            expect[("training", "rounds")] = rounds
            expect[("training", "lr")] = lr
            tree.append(("x_merge_probe", ("text", "{<<: *tr, lr: 0.2}" if over else "*tr")))
            refuse.append("x_merge_probe")
            yaml_only = True
        elif change == "bomb":
            levels, fan = draw(st.integers(1, 7)), draw(st.integers(2, 9))
            where = draw(st.sampled_from(["top", "unknown", "field"]))
            b = f"b{len(tree)}_"  # anchors unique in the document (PyYAML refuses one defined twice)
            lines = [f"{b}0: &{b}0 [{', '.join(['lol'] * fan)}]"]
            lines += [f"{b}{i}: &{b}{i} [" + ", ".join([f"*{b}{i - 1}"] * fan) + "]" for i in range(1, levels)]
            body = "{" + ", ".join(lines) + "}"
            key = {"top": f"bombs{len(tree)}", "unknown": f"bogus{len(tree)}", "field": "seed"}[where]
            if key == "seed" and any(k == "seed" for k, _ in tree):
                key = f"bombs{len(tree)}"
            tree.append((key, ("text", body)))
            size, s_i = 1, 0  # the expanded node count, as the loader counts it (every alias a copy)
            for i in range(levels):
                s_i = 1 + fan * (s_i if i else 1)
                size += 1 + s_i
            if size > MAX_YAML_NODES:
                refuse.append("more than")
            elif size < MAX_YAML_NODES - 1000:
                refuse.append(key)
            else:  # at the limit, the rest of the document decides
                refuse.extend(["more than", key])
            yaml_only = True
    anchors = [w[1:] for w in text_words(tree) if w.startswith("&")]
    if len(anchors) != len(set(anchors)):
        refuse.append("duplicate anchor")  # PyYAML's composer meets an anchor defined twice before any key check
    if yaml_only:
        suffix = ".yaml"
    if suffix == ".json":
        if any(tag == "text" for _, (tag, _) in tree):
            suffix = ".yaml"
    if suffix == ".json":
        text = "{" + _render_json(tree) + "}"
    else:
        text = "\n".join(_render_yaml(tree)) + "\n"
    return Doc(text, suffix, tuple(refuse), tuple(sorted(expect.items())))


def text_words(tree: list) -> list[str]:
    return " ".join(_render_yaml(tree)).replace("[", " ").replace("{", " ").replace(",", " ").split()


def _is_map(tree: list, key: str) -> bool:
    return any(k == key and tag == "map" for k, (tag, _) in tree)


# ----------------------------------------------------------------------------------------- tables
# Hostile tables (issue 52): a results folder first laid out another legitimate way (a run's files split into the
# parts a killed run leaves, ``compact``), then one or two of its table files made hostile. Each hostile action
# says what a reader must then do (:class:`Expect`): refuse naming the file, or read every run as the intact folder
# reads it, up to the columns the action changed, or either.

TABLE_FOLDERS = ("runs", "rounds", "clients", "layers", "allocations")


@dataclass(frozen=True)
class Expect:
    """What readers must do after hostile actions: ``refuse`` (the kinds of refusal the actions call for: a reader
    must refuse; ``"config"`` is a damaged config_json, which ``compact`` moves without reading), ``either`` (a
    refusal or a read are both right: a column retyped, which reads back exactly or is refused), and ``differs``
    ((table, run, column): what a read may show changed; every other value as in the intact folder)."""

    refuse: frozenset[str] = frozenset()
    either: bool = False
    differs: frozenset[tuple[str, str, str]] = frozenset()

    def __add__(self, other: Expect) -> Expect:
        return Expect(self.refuse | other.refuse, self.either or other.either, self.differs | other.differs)


NOTHING = Expect()
LAYOUTS = {"split": ["parts", "kept", "live"], "compact": [None]}
HOSTILE: dict[str, list[Any]] = {
    "copy-as": ["ghost", "part2", "part4", "part9", "compacted", "compacted-edited", "misplace"],
    "dup-rows": [1, 2, 3],
    "version": [0, -1, "newer", 99, 2**31 - 1, None, 1, 5],
    "add-col": ["note", "accuracy_2", "layer", "p", "domain", "status", "dup"],
    "drop-col": list(range(8)),
    "retype": ["string", "large_string", "float64", "int32", "int64", "bool", "timestamp", "dictionary", "null"],
    "config": ["not-json", "list", "number", "string", "true", "truncated", "deep"],
    "drop-round": [None],  # a merged per-run file loses a round whose part it says it holds (its upto_round)
}
table_layouts = st.sampled_from(sorted(LAYOUTS)).flatmap(
    lambda kind: st.builds(Act, st.just(kind), st.integers(0, 999), st.sampled_from(LAYOUTS[kind])))
table_hostile = st.sampled_from(sorted(HOSTILE)).flatmap(
    lambda kind: st.builds(Act, st.just(kind), st.integers(0, 999), st.sampled_from(HOSTILE[kind])))
# 0-2 legitimate layouts, then 1-2 hostile actions (each on a file no earlier action touched)
table_acts = st.tuples(st.lists(table_layouts, max_size=2), st.lists(table_hostile, min_size=1, max_size=2)).map(
    lambda lh: [*lh[0], *lh[1]])


def table_files(out: Path) -> list[str]:
    """The Parquet files of the table folders, relative to ``out``, sorted."""
    return [rel for rel in entries(out, "file") if rel.split("/")[0] in TABLE_FOLDERS and rel.count("/") == 1
            and rel.endswith(".parquet") and not rel.split("/")[1].startswith((".", "_"))]


def _name(rel: str) -> tuple[str, str | None, int | None]:
    """(table, run, round) a file's name gives it: a per-run file (run, None), a part (run, round), compacted (None)."""
    from fedsap_ray.results import COMPACTED_PREFIX, PART_SEP

    table, name = rel.split("/")
    stem = name.removesuffix(".parquet")
    if stem.startswith(COMPACTED_PREFIX):
        return table, None, None
    run, sep, rnd = stem.rpartition(PART_SEP)
    return (table, run, int(rnd)) if sep and rnd.isdigit() else (table, stem, None)


def _upto(path: Path) -> float:
    from fedsap_ray.results import UPTO_KEY

    v = (pq.read_schema(path).metadata or {}).get(UPTO_KEY)
    return float(int(v)) if v is not None else float("inf")


def _runs_read(out: Path, rel: str) -> set[str]:
    """The runs whose rows in file ``rel`` a reader reads: a compacted file's runs without a per-run file or part of
    their own in the table, a part's run unless its per-run file holds the part's round, a per-run file's run."""
    table, run, rnd = _name(rel)
    if run is None:
        ids = set(pq.read_table(out / rel, columns=["run_id"]).column("run_id").to_pylist())
        own = {_name(f)[1] for f in table_files(out) if f.startswith(f"{table}/") and _name(f)[1] is not None}
        return ids - own
    home = out / table / f"{run}.parquet"
    if rnd is not None and home.is_file() and _upto(home) >= rnd:
        return set()
    return {run}


def _held(out: Path, rel: str) -> list[int]:
    """The rounds of the parts a per-run file's upto_round says it holds (readers skip those parts)."""
    table, run, rnd = _name(rel)
    if table == "runs" or run is None or rnd is not None:
        return []
    upto = _upto(out / rel)
    return sorted(r for f in table_files(out) if f.startswith(f"{table}/") and _name(f)[1] == run
                  and (r := _name(f)[2]) is not None and r <= upto)


def _rewrite(path: Path, change) -> None:
    t = pq.read_table(path)
    pq.write_table(change(t), path)  # schema metadata (a per-run file's upto_round) kept


def _set(t: pa.Table, name: str, values: Any) -> pa.Table:
    return t.set_column(t.schema.get_field_index(name), name, values)


def apply_table(act: Act, out: Path, touched: set[str]) -> tuple[str, Expect]:
    """Do ``act`` to the results folder ``out`` (a file no earlier action touched; ``touched`` gains it and any file
    it creates); return what was done (one line) and what a reader must then do."""
    from fedsap_ray import results

    if act.kind == "compact":
        results.compact(out)
        return "compact", NOTHING
    files = [f for f in table_files(out) if f not in touched]
    if act.kind == "split":
        whole = [f for f in files if f.split("/")[0] != "runs" and _name(f)[2] is None and _name(f)[1] is not None]
        rel = _pick(whole, act.pick)
        if rel is None:
            return "split: no per-run file", NOTHING
        return _split(out, rel, act.arg), NOTHING
    if act.kind == "config":
        files = [f for f in files if f.startswith("runs/")]
    if act.kind == "drop-round":
        files = [f for f in files if _held(out, f)]
    rel = _pick(files, act.pick)
    if rel is None:
        return f"{act.kind}: no untouched table file", NOTHING
    touched.add(rel)
    table = rel.split("/")[0]
    p = out / rel
    read = _runs_read(out, rel)
    t = pq.read_table(p)
    if act.kind == "copy-as":
        return _copy_as(out, rel, act, touched, t)
    if act.kind == "drop-round":
        rnd = _held(out, rel)[act.pick % len(_held(out, rel))]
        _rewrite(p, lambda t: t.filter(pc.field("round") != rnd))
        return f"drop-round {rel}: round {rnd}, which a part holds", Expect(frozenset({"held"}))
    if act.kind in ("dup-rows", "version", "config"):
        if not t.num_rows:
            return f"{act.kind} {rel}: no rows", NOTHING
        i = act.pick % t.num_rows
        if act.kind == "dup-rows":
            _rewrite(p, lambda t: pa.concat_tables([t, t.slice(i, act.arg)]))
            runs = set(t.slice(i, act.arg).column("run_id").to_pylist())
            return f"dup-rows {rel}: rows {i}..{i + act.arg - 1} again", Expect(frozenset({"dup"})) if runs & read else NOTHING
        run = t.column("run_id")[i].as_py()
        if act.kind == "config":
            bad = {"not-json": '{"seed": 1,', "list": "[1, 2]", "number": "7", "string": '"x"', "true": "true",
                   "truncated": (t.column("config_json")[i].as_py() or "{}")[:-1], "deep": "[" * 5000 + "]" * 5000}[act.arg]
            _rewrite(p, lambda t: _set(t, "config_json", pa.array([bad if k == i else v for k, v in
                                                                   enumerate(t.column("config_json").to_pylist())], pa.string())))
            return f"config {rel}: run {run}'s config_json {act.arg}", Expect(frozenset({"config"})) if run in read else NOTHING
        v = results.SCHEMA_VERSION + 1 if act.arg == "newer" else act.arg
        every = act.pick % 2 == 0
        _rewrite(p, lambda t: _set(t, "schema_version", pa.array(
            [v if every or k == i else old for k, old in enumerate(t.column("schema_version").to_pylist())], pa.int32())))
        hit = (set(t.column("run_id").to_pylist()) if every else {run}) & read
        how = f"version {rel}: {'every row' if every else f'row {i}'} {v!r}"
        if not hit:
            return how, NOTHING
        if v is not None and not 1 <= v <= results.SCHEMA_VERSION:
            return how, Expect(frozenset({"version"}))
        return how, Expect(differs=frozenset((table, r, "schema_version") for r in hit))
    # file-level: a column added, dropped or retyped
    if act.kind == "add-col":
        name = t.column_names[act.pick % t.num_columns] if act.arg == "dup" else act.arg
        _rewrite(p, lambda t: t.append_column(name, pa.array(["x"] * t.num_rows)))
        how = f"add-col {rel}: {name}"
        if not read:
            return how, NOTHING
        if name in t.column_names:
            return how, Expect(frozenset({"dup-col"}))
        if name in results.schema(table).names:
            return how, Expect(either=True, differs=frozenset((table, r, name) for r in read))
        return how, NOTHING
    name = t.column_names[act.pick % t.num_columns]
    if act.kind == "drop-col":
        _rewrite(p, lambda t: t.drop_columns([name]))
        how = f"drop-col {rel}: {name}"
        if not read:
            return how, NOTHING
        versions = [v for v in t.column("schema_version").to_pylist() if v is not None] if "schema_version" in t.column_names else []
        if name in results.required_columns(table, max(versions, default=1)):
            return how, Expect(frozenset({"missing"}))
        return how, Expect(differs=frozenset((table, r, name) for r in read))
    to = {"string": pa.string(), "large_string": pa.large_string(), "float64": pa.float64(), "int32": pa.int32(),
          "int64": pa.int64(), "bool": pa.bool_(), "timestamp": pa.timestamp("ns", tz="UTC"), "null": pa.null()}
    col = t.column(name)
    try:
        if act.arg == "dictionary":
            new = col.dictionary_encode()
        elif act.arg == "null":
            if col.null_count != len(col):
                raise pa.ArrowInvalid("values")
            new = pa.nulls(len(col))
        else:
            new = pc.cast(col, to[act.arg])
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
        return f"retype {rel}: {name} cannot be {act.arg}", NOTHING
    _rewrite(p, lambda t: _set(t, name, new))
    return f"retype {rel}: {name} {col.type} -> {new.type}", Expect(either=True) if read else NOTHING


def _copy_as(out: Path, rel: str, act: Act, touched: set[str], t: pa.Table) -> tuple[str, Expect]:
    table, run, _ = _name(rel)
    if act.arg == "misplace":  # into another table's folder, under a run's name: told apart and skipped
        other = TABLE_FOLDERS[(TABLE_FOLDERS.index(table) + 1 + act.pick % 4) % 5]
        (out / other).mkdir(exist_ok=True)
        new = f"{other}/stray.parquet"
    elif act.arg in ("compacted", "compacted-edited"):
        new = f"{table}/compacted-fz{act.pick:06d}.parquet"
    elif act.arg == "ghost":
        new = f"{table}/ghost.parquet"
    else:
        new = f"{table}/{run or 'done'}@r{int(act.arg[4:]):06d}.parquet"
    if (out / new).exists() or (out / new).is_symlink():
        return f"copy-as {rel} -> {new}: taken", NOTHING
    shutil.copy(out / rel, out / new)
    touched.add(new)
    how = f"copy-as {rel} -> {new}"
    if act.arg == "compacted-edited" and t.num_rows:  # the copy holds another run under a run's id
        i = act.pick % t.num_rows
        col = next((c for c in t.column_names if pa.types.is_floating(t.schema.field(c).type) and t[c][i].is_valid), None)
        if col is None:
            return how + " (nothing to edit)", NOTHING
        _rewrite(out / new, lambda t: _set(t, col, pa.array([v + 1.0 if k == i else v
                                                             for k, v in enumerate(t.column(col).to_pylist())])))
        run = t.column("run_id")[i].as_py()
        how += f", {col} of row {i} + 1"
        return how, Expect(frozenset({"conflict"})) if run in _runs_read(out, new) else NOTHING
    if act.arg in ("misplace", "compacted", "compacted-edited") or not t.num_rows or not _runs_read(out, new):
        return how, NOTHING  # skipped; a copy of rows read from their own files; no rows; a part its run's file holds
    _, run_of, round_of = _name(new)
    ids = set(t.column("run_id").to_pylist())
    rounds = set(t.column("round").to_pylist()) if "round" in t.column_names else {round_of}
    if ids == {run_of} and rounds == {round_of}:  # the rows its name says (a runs row: no round): what the run wrote
        return how, NOTHING
    return how, Expect(frozenset({"copy"}))


def _split(out: Path, rel: str, how: str) -> str:
    """A run's per-run file as the parts a killed run leaves: ``parts`` (never merged), ``kept`` (merged, the parts
    not deleted yet), ``live`` (merged up to the round before its last, the last still a part)."""
    from fedsap_ray.results import UPTO_KEY, part_name

    table, run, _ = _name(rel)
    t = pq.read_table(out / rel)
    rounds = sorted(set(t.column("round").to_pylist()))
    if not rounds:
        return f"split {rel}: no rows"
    merged = {"parts": 0, "kept": rounds[-1], "live": rounds[-1] - 1}[how]
    for r in rounds:
        if r > merged or how == "kept":
            pq.write_table(t.filter(pc.field("round") == r).replace_schema_metadata(None), out / table / part_name(run, r))
    if how == "parts":
        (out / rel).unlink()
    else:
        pq.write_table(t.filter(pc.field("round") <= merged).replace_schema_metadata({UPTO_KEY: str(merged).encode()}),
                       out / rel)
    return f"split {rel}: {how}"
