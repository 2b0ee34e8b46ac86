"""The wire contract: .proto files and their generated Python modules."""
