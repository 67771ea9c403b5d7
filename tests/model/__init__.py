"""An explicit-state model of docs/exactly-once.md and an exhaustive checker for small bounds."""
