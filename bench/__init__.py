"""Benchmark suite: the keyed-state path side by side with the alternatives and the physical limit.

Run with ``make bench`` (full) or ``make bench-quick``; see ``python -m bench --help``.
"""
