"""The serving engine: model shell, batching, expert dispatch, HTTP and gRPC APIs."""
