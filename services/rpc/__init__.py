"""The protobuf side of the expert service: the modules generated from proto/*.proto (regenerate:
`make proto`) and `wire`, the hand-written zero-copy codec of its hot messages (Dispatch, the
peer copy's ExpertWeights). The transports that carry them are services/dataplane."""
