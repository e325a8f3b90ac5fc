"""``benchmarks/zbv_measured_cpu.py`` in modules: what runs inside the ranks (``ranks``) and what the launcher makes
of it (``report``); the model, flags and launch are ``zb_measured_cpu.py``'s (``zb_mcpu.common``)."""
