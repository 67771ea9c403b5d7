"""JobManager high availability: what a restarted JobManager needs to resume every job.

With ``high-availability.type: filesystem`` the JobManager keeps, under
``<high-availability.storageDir>/<high-availability.cluster-id>/``::

    leader/session-<n>                       leadership sessions (create-only; newest wins)
    jobs/<job-id>/job.json                   the job record: spec, status, routing version
    jobs/<job-id>/checkpoint-counter         the checkpoint id counter (ids never go backwards)
    jobs/<job-id>/checkpoints/<n>.json       pointers to completed checkpoints' _metadata

This is what Flink keeps in ZooKeeper or Kubernetes ConfigMaps, kept in any fsspec file
system instead: every write is atomic (object stores) or create-only, so a JobManager killed
at any instant leaves either the old or the new record, never half of one.
"""

from keyedstate.jobmanager.ha.services import HighAvailabilityServices, create_ha_services

__all__ = ["HighAvailabilityServices", "create_ha_services"]
