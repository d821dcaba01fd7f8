"""Tensor parallelism over torch.distributed (gloo on CPU, NCCL on GPU).

- ``group.py``: the process group of one engine (rank, world size, device and
  CPU groups, timeouts) and the few collectives the engine uses.
- ``layers.py``: row-parallel linear, vocab-parallel embedding, and how a full
  tensor is cut for one rank.
- ``tp_decoder.py``: what every TP decoder shares (row-parallel o/down projections, vocab-parallel
  ends, cutting full tensors for a rank).
- ``tp_gqa.py``: grouped-query attention split over ranks (query heads split, KV heads split or
  replicated, the dense MLP split), shared by the families below.
- ``tp_llama.py``: the Llama family.
- ``tp_hybrid.py``: Gemma 3 and gpt-oss (experts split by index).
- ``tp_deepseek.py``: DeepSeek-V2/V3 (MLA heads split, latent cache replicated,
  routed experts split by index).
- ``tp_qwen3_next.py`` / ``tp_kimi_linear.py``: the linear-attention hybrids (Gated DeltaNet / KDA heads
  and their state slots split, gated attention / MLA heads split, experts by index).
- ``runner.py``: rank 0 broadcasts each step's inputs; every rank runs the model (and, with a
  draft model, the draft's slice over its pool's draft layers).
- ``launcher.py`` (rank 0) and ``worker.py`` (ranks 1..N-1): processes, startup
  checks (per-rank KV bytes against the plan), watchdog, shutdown.

The TP=1 engine never imports this package.
"""
