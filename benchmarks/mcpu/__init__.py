"""``benchmarks/measured_cpu.py`` in modules: the scenarios and shared settings (``scenarios``), a plan's cut and
split (``splits``), what runs inside the two ranks (``ranks``), and how the launcher simulates, judges and prints the
results (``analysis``, ``report``)."""
