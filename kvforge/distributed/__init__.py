"""Tensor parallelism over torch.distributed (gloo on CPU, NCCL on GPU).

- ``group.py``: the process group of one engine (rank, world size, device and
  CPU groups, timeouts) and the few collectives the engine uses.
- ``layers.py``: row-parallel linear, vocab-parallel embedding, and how a full
  tensor is cut for one rank.
- ``tp_llama.py``: the Llama family with per-rank heads, KV heads, MLP and vocab.
- ``tp_deepseek.py``: DeepSeek-V2/V3 (MLA heads split, latent cache replicated,
  routed experts split by index).
- ``runner.py``: rank 0 broadcasts each step's inputs; every rank runs the model.
- ``launcher.py`` (rank 0) and ``worker.py`` (ranks 1..N-1): processes, startup
  checks (per-rank KV bytes against the plan), watchdog, shutdown.

The TP=1 engine never imports this package.
"""
