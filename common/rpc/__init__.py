"""gRPC plumbing shared by daemons and clients: status mapping, channels, servers."""
