"""Analysis of fedsap_ray Parquet results (importable: ``from analysis import sweep, ablation, comparison,
confound, sensitivity, plots``; ``analysis.fedsap`` is the older Table 5 table, kept for folders written
before the ablation sweep)."""
