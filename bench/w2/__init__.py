"""Workload W2, "sessionization": per user, events in time order open or extend a session (gap 30 min).

A session lives in keyed state as a ListState of its event times plus a ValueState with its
start; an event more than :data:`~bench.w2.data.GAP_S` after the session's last event closes it,
and the closed session is emitted with its count and duration. One module per concern:
:mod:`.data` (the Parquet input and the plain-Python reference), :mod:`.executor` (the session
logic and the code Spark's Python workers run), :mod:`.sparkjobs` (the streaming variants:
ours, ``transformWithStateInPandas``, ``applyInPandasWithState``).
"""
