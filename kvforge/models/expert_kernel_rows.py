"""How many routed rows per expert a step may have for the Triton expert kernel: the bound the kernel route
(kvforge/models/expert_gemm_route.py) applies and the planner's activation estimate
(kvforge/planner/activations.py) mirrors. No torch here, so the planner can read it."""

from __future__ import annotations

#: The most routed rows per routed expert (the step's rows over the weight's experts) for the kernel. Over 64
#: experts, 128 tokens x top-6 (12 rows an expert) ran 1.29-1.30x ``torch._grouped_mm``, 256 x top-6 (24)
#: 0.65-0.73x: an expert with more than 16 rows reads its weight once per 16.
TRITON_EXPERT_GEMM_MAX_ROWS_PER_EXPERT = 12


def kernel_takes_rows(routed_rows: int, routed_experts: int,
                      max_rows_per_expert: int = TRITON_EXPERT_GEMM_MAX_ROWS_PER_EXPERT) -> bool:
    """Whether ``routed_rows`` rows over ``routed_experts`` experts are few enough for the kernel."""
    return 0 < routed_rows <= max_rows_per_expert * routed_experts
