"""The expert data plane's transport: the protobuf/gRPC modules generated from proto/*.proto
(regenerate: `make proto`) and `wire`, the hand-written zero-copy codec of the hot messages."""
