"""gRPC servicer of the JobManager: a thin adapter over the Dispatcher."""
