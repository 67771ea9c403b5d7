"""Workload W1, "keyed running aggregate": state[user] = (count + 1, sum + amount) per event.

One module per concern: :mod:`.data` (the Parquet input and the reference), :mod:`.local`
(the single-process baselines), :mod:`.sparkjobs` (the Spark session and the streaming
variants: ours, native aggregation, transformWithStateInPandas, Redis).
"""
