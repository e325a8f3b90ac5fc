"""The parts of ``benchmarks/replan_cpu.py``: its cases, what runs inside the ranks, and its report."""
