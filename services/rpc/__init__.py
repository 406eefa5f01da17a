"""Generated protobuf/gRPC modules of proto/*.proto (regenerate: `make proto`)."""
