"""``benchmarks/predict_vs_measure.py`` in modules: the scenarios (``scenarios``), what runs inside the ranks
(``calibration``, ``splits``, ``ranks``, ``predictions``), and how the launcher reads and prints the results
(``analysis``, ``report``)."""
