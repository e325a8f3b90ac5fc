"""``benchmarks/zb_measured_cpu.py`` in modules: what it shares with ``zbv_measured_cpu.py`` (``common``: the model,
the flags, the launch), what runs inside the ranks (``ranks``) and what it prints (``report``)."""
