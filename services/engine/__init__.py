"""The inference engine: what turns requests into tokens over the model (services/model).

`engine.Engine` (one step at a time: scheduler, model, expert backend, sampler) and `LocalEngine`
(every routed expert in process), `engine_config` (what an engine runs), `speculative`
(speculative decoding with the checkpoint's MTP module as the drafter), `scheduler` (continuous batching, chunked prefill, preemption),
`block_allocator` (the paged cache's blocks, automatic prefix caching), `sampling`, `grammar`
(structured outputs), `tokenizer` (and the incremental detokenizer), `decode_graphs` (CUDA graphs
of decode steps), `outputs` (what the engine gives back). Pure like the model: no gRPC, Ray,
Redis or sockets; the attention worker and the router wire it.
"""
