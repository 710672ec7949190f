"""``fedsap_ray.data.base.check_labels``: the one label check every file-reading loader runs (issue 43: it
lived privately in digits.py, and EMNIST and Office-Caltech's SURF reader each had their own copy, which
raised a plain ValueError, exit 1, instead of naming the file with exit 2)."""
from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from fedsap_ray.data import base
from fedsap_ray.data.base import check_labels
from fedsap_ray.common.errors import DatasetUnreadable

DATA = Path(base.__file__).parent


def test_labels_outside_the_classes_name_the_dataset_domain_and_files(tmp_path) -> None:
    f = tmp_path / "mnist.npz"
    with pytest.raises(DatasetUnreadable) as e:
        check_labels("mnist", "mnist", np.array([0, 12, 3]), 10, (f,))
    assert str(e.value) == (f"mnist: domain 'mnist' has labels outside 0..9 (min 0, max 12) in {f}; the file is "
                            "damaged or holds another dataset: fetch it again")
    with pytest.raises(DatasetUnreadable, match=r"labels outside 0..61 \(min -1, max 5\); the file"):
        check_labels("emnist", "emnist", np.array([-1, 5]), 62)


def test_labels_inside_the_classes_and_empty_splits_pass() -> None:
    check_labels("cifar10", "cifar10", np.arange(10), 10)
    check_labels("cifar10", "cifar10", np.zeros(0, np.int64), 10)


def test_every_loader_that_checks_labels_uses_the_shared_check() -> None:
    """No module that registers a dataset words its own label-range check (the shared one names the files
    and exits 2). ``partition.label_counts`` keeps its own: a histogram's guard against a caller's bug."""
    loaders = [p for p in sorted(DATA.glob("*.py")) if "register_dataset(" in p.read_text(encoding="utf-8")
               and p.name not in ("registry.py", "base.py")]  # base.py: where the shared check lives
    assert {"digits.py", "mnist.py", "cifar.py", "emnist.py", "office.py"} <= {p.name for p in loaders}
    hits = []
    for path in loaders:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and "labels outside" in node.value:
                hits.append(f"{path.name}:{node.lineno}")
    assert not hits, f"label checks written by hand (use fedsap_ray.data.base.check_labels): {hits}"
