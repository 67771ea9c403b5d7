"""Command-line tools (statectl)."""
