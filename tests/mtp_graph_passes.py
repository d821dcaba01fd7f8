"""Helpers for tests of an MTP runner's graph path (CPU: the static, padded inputs of ``static_decode_on_cpu``;
CUDA: captured graphs): engines whose runners take the static inputs on CPU, and every pass a graph serves
run a second time eagerly on the same inputs."""

from __future__ import annotations


def use_static_graph_inputs(monkeypatch) -> None:
    """Engines built after this run their runners' graph paths on CPU over the static, padded inputs
    (``static_decode_on_cpu``): the target's decode and verification steps and an MTP layer's passes."""
    from kvforge.engine import llm_engine

    class StaticDecodeRunner(llm_engine.ModelRunner):
        def __init__(self, *a, **kw):
            super().__init__(*a, **{**kw, "static_decode_on_cpu": True})

    monkeypatch.setattr(llm_engine, "ModelRunner", StaticDecodeRunner)


def run_graph_passes_twice(runner) -> list[tuple[int, int, float]]:
    """Patch ``runner`` (a ModelRunner with ``mtp_proposals``) so that each pass a graph serves is also run
    eagerly; the graph's output goes on. Returns the list the patch fills: per replayed pass, (sequences,
    query length, max |graph - eager| / max |eager|) of the head inputs."""
    passes: list[tuple[int, int, float]] = []
    layer = runner._mtp_layer

    def both(host, hidden, rows=None):
        if not runner.wants_graph(host):
            return layer(host, hidden, rows)
        graphed = layer(host, hidden, rows).clone()  # a replay's output is valid until the next replay
        static, runner.mtp_hidden = runner.mtp_hidden, None  # no static input: the eager pass
        try:
            eager = layer(host, hidden, rows)
        finally:
            runner.mtp_hidden = static
        scale = eager.float().abs().max().clamp(min=1e-30)
        passes.append((host.num_seqs, host.max_query_len, ((graphed.float() - eager.float()).abs().max() / scale).item()))
        return graphed

    runner._mtp_layer = both
    return passes
