"""The input scaling of every dataset is stated, and true (issue 53): each package dataset declares its kinds of input
where it is registered, the datasets reference and docs/guides/data.md state each kind's transform from
fedsap_ray.data.base.INPUT_SCALING, that statement is what as_input computes, and a load of an undeclared kind is
refused."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fedsap_ray.dev import docgen
from fedsap_ray.config import build_config
from fedsap_ray.data import as_input, load_splits
from fedsap_ray.data.base import INPUT_SCALING
from fedsap_ray.data.registry import DomainSplits, check_inputs, dataset_names, get_source


def test_the_stated_image_transform_is_what_as_input_computes():
    x = torch.arange(256, dtype=torch.uint8).reshape(1, 1, 16, 16)
    assert "x * 2/255 - 1" in INPUT_SCALING["image"]
    np.testing.assert_array_equal(as_input(x).numpy(), (x.numpy().astype(np.float32) * np.float32(2 / 255) - 1))
    assert as_input(x).min() == -1 and as_input(x).max() == 1 and as_input(x).dtype == torch.float32
    f = torch.randn(3, 5)
    assert as_input(f) is f  # features (and token ids) pass unchanged, as stated


def test_every_package_dataset_declares_its_inputs_and_the_reference_states_their_scaling():
    page = docgen.datasets_page()
    for name in dataset_names():
        kinds = get_source(name).input_kinds
        assert kinds and set(kinds) <= set(INPUT_SCALING), name
        row = next(line for line in page.splitlines() if line.startswith(f"| `{name}` |"))
        for k in kinds:
            assert docgen.cell(INPUT_SCALING[k]) in row, (name, k)
    assert "x \\* 2/255 - 1" in docgen.input_scaling()


def test_a_load_of_another_kind_than_declared_is_refused():
    splits = load_splits(build_config(preset="smoke"))  # embedded_digits: declared image, loads image
    assert check_inputs(get_source("embedded_digits"), splits) is splits
    feats = DomainSplits(dataset="x", domains=["d"], train={}, test={}, num_classes=2, input_kind="features",
                         input_shape=(3,))
    with pytest.raises(TypeError, match="declares inputs \\('image',\\) but its load gave 'features'"):
        check_inputs(get_source("embedded_digits"), feats)
