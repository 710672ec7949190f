"""Analysis of fedsap_ray Parquet results (importable: ``from analysis import fedsap, confound``)."""
