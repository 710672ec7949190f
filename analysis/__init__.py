"""Analysis of fedsap_ray Parquet results (importable: ``from analysis import sweep, ablation, comparison,
confound, sensitivity, plots``).

One vocabulary: :mod:`analysis.runs` loads a folder and builds the one per-run table
(:func:`analysis.runs.per_run`) that every study's table starts from; :mod:`analysis.labels` names a run
by its resolved options (:func:`analysis.labels.label`, the only run label; a study maps it to its paper's
row names); :mod:`analysis.metrics` computes the per-run figures; :mod:`analysis.display` formats tables
and renders markdown with :meth:`pandas.DataFrame.to_markdown`."""
