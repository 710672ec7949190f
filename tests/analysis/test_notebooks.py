"""The analysis notebooks run top to bottom on the study folders the sweep scripts write and show
their figures.

Each study's folder is what ``python sweeps/<study>.py --smoke-test`` writes (the session fixture
``smoke_study`` runs each script once); every notebook is executed with nbclient on the python3
kernel of this environment (ipykernel), its first cell pointed at that folder.
"""
from __future__ import annotations

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="install the test extra: pip install -e '.[test]'")
nbclient = pytest.importorskip("nbclient", reason="install the test extra: pip install -e '.[test]'")

from fedsap_ray import results  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = REPO / "analysis" / "notebooks"
STUDIES = ["sensitivity", "ablation", "main_comparison", "capacity_confound"]


@pytest.fixture(scope="module")
def folders(smoke_study) -> dict[str, Path]:
    """Each study's folder as its script's ``--smoke-test`` writes it (shared with tests/sweeps/test_sweeps.py)."""
    return {study: smoke_study(study) for study in STUDIES}


def _outputs(nb) -> list[dict]:
    return [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]


@pytest.mark.parametrize("study", list(STUDIES))
def test_committed_notebook_is_clean_and_points_at_its_study(study) -> None:
    nb = nbformat.read(NOTEBOOKS / f"{study}.ipynb", as_version=4)
    nbformat.validate(nb)
    assert nb.cells[0].cell_type == "code" and nb.cells[0].source == f'RESULTS = "runs/{study}"'
    assert not _outputs(nb) and all(c.get("execution_count") is None for c in nb.cells if c.cell_type == "code")


@pytest.mark.parametrize("study", list(STUDIES))
def test_notebook_runs_on_a_study_folder_and_shows_figures(study, folders) -> None:
    nb = nbformat.read(NOTEBOOKS / f"{study}.ipynb", as_version=4)
    nb.cells[0].source = f"RESULTS = {str(folders[study])!r}"
    # raises CellExecutionError (with the cell and traceback) on any error
    nbclient.NotebookClient(nb, kernel_name="python3", timeout=300,
                            resources={"metadata": {"path": str(REPO)}}).execute()
    outs = _outputs(nb)
    assert not [o for o in outs if o.get("output_type") == "error"]
    images = [o for o in outs if "image/png" in o.get("data", {})]
    assert len(images) >= 1
    printed = "".join(o.get("text", "") for o in outs if o.get("output_type") == "stream")
    n_runs = len(results.load(folders[study]).runs)
    assert f"{n_runs} runs in {folders[study]}" in printed
    assert any("text/html" in o.get("data", {}) or "text/markdown" in o.get("data", {}) for o in outs)  # tables


def test_sensitivity_notebook_shows_table7_with_a_shared_reference(folders) -> None:
    """The smoke sweep's folder gives the whole of Table 7: every factor has the reference run and
    every value of the paper's list (papers/000 Table 7), in the paper's order."""
    from analysis import sensitivity

    t = sensitivity.sensitivity_table(folders["sensitivity"])
    ref = t[t["reference"].astype(bool)]
    assert list(ref["factor"]) == list(sensitivity.FACTORS) and (ref["variants"] == "ref").all()
    assert (t["seeds"] == 1).all()
    assert {f: list(t.loc[t["factor"] == f, "value"]) for f in sensitivity.FACTORS} == {
        "g_target": [0.5, 0.6, 0.7, 0.8, 0.9, 0.95], "tau_var": [0.05, 0.1, 0.2, 0.3, 0.5],
        "beta_ema": [0.3, 0.5, 0.7, 0.9]}
