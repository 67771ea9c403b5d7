"""In-process fakes for time: a manual clock and a manual scheduler (no threads, no sleeping)."""
