"""``benchmarks/predict_vs_measure.py`` in modules, one concept each: the scenarios (``scenarios``)."""
