"""The data plane: how one MoE layer's rows travel from an attention worker to the expert
workers holding their slots, and back. Client and server side of every transport live here.

    placement.py       which logical expert each physical slot holds, and which worker holds it
    slot_router.py     (token, choice) pairs -> slots -> workers (replicas, resends; pure torch)
    remote_experts.py  the attention worker's client: dispatch / combine over the transports
    transport.py       one transport chosen per (attention worker, expert worker) pair
    frames.py          the fixed frames of shm and TCP: layout, status codes, checks, accept loop
    shm.py             shared memory on one node (client channel and server)
    tcp.py             plain / TLS TCP between nodes (client channel and server)
    grpc_stream.py     gRPC DispatchStream, the portable path (client stream and server handlers)
    auth.py, tls.py    the cluster's secret and the TLS identity derived from it

The expert worker's process (services/experts) hosts the servers; the attention worker
(services/attention) holds a `RemoteExperts`. Protobuf codecs are services/rpc.
"""
