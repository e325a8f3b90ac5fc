"""``benchmarks/in_run_accuracy.py`` in modules: what each scenario trains (``scenarios``), what runs inside the ranks
(``ranks``), and how the results are judged and printed (``report``)."""
