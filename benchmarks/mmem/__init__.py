"""``benchmarks/measured_memory.py`` in modules: the scenarios (``scenarios``), one scenario planned and measured in
its ranks (``measure``), and what is printed and checked (``report``)."""
