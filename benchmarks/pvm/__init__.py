"""``benchmarks/predict_vs_measure.py`` in modules, one concept each: the scenarios and what their ranks read
(``scenarios``), and what runs inside the ranks (``calibration``, ``splits``, ``ranks``, ``predictions``)."""
