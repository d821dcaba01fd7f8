"""Which kernel serves a batch, and with how many context splits: one torch-free table per backend.

Each module holds plain data (the kernels, when each applies, how its splits are chosen) and pure functions
over integers and dtype names. The eager launchers, the CUDA-graph split pinning, the planner's backend
declarations and docs/ROUTING.md all read these tables; kernel modules only launch what a table chose.

- :mod:`.platform`: where the Gluon kernels may run (Triton version, compute capability, the switch).
- :mod:`.split_k`: the one split-K rule, parametrized per kernel.
- :mod:`.paged`: the Triton paged-attention backend (tl.dot kernel, Gluon fp8 decode kernels).
- :mod:`.mla`: the Triton MLA backend (decode kernels, e4m3 query, prefill path).
- :mod:`.torch_backends`: the PyTorch reference backends and the ring (one path each).
- :mod:`.delta_rule`: the linear-attention prefill's form on CUDA (token by token or chunked) and the chunked
  form's buffers, which the planner's activation reserve counts.
"""
