"""Generated protobuf and gRPC code (see proto/generate.py). Never edit by hand."""
