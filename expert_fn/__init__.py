"""The expert function: a gRPC server that holds a bundle of (layer, expert) weights and runs them."""
