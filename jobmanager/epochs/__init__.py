"""Exactly-once epochs on the JobManager: commits and durability (the lineage of Spark batches is
:mod:`keyedstate.jobmanager.lineage`, below both this package and the checkpoint domain).

See docs/exactly-once.md for the protocol.
"""
