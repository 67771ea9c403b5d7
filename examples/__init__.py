"""Runnable examples; ``main_job`` is what the README's first command runs."""
