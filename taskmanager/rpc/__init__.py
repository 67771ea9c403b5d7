"""gRPC servicers of the TaskManager: thin adapters between proto messages and domain calls."""
