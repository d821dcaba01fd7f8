"""A tensor-parallel worker process (ranks 1..N-1): ``python -m kvforge.distributed.worker``.

Reads the startup context from stdin (8-byte length + pickle, written by
rank 0's launcher), joins the process group, builds its model slice and KV
pool (and the draft model's slice, with speculative method draft_model),
reports them to rank 0, then runs one target step per ``s`` byte on stdin, one
draft step per ``d``, one call of the MTP layer per ``m``, receives rank 0's sampled tokens of the last target step
per ``t`` (async scheduling), publishes its step counters for ``c`` and sets
them to zero for ``z`` (after the startup warm-up), until ``q`` or end-of-file. SIGINT and
SIGTERM are ignored: a Ctrl-C, ``timeout`` or a service manager's stop reaches the
whole process group, and rank 0 decides when the workers stop (the server drains
its requests first, then ends them; rank 0 ends a worker with SIGKILL). Any failure
ends the process with a non-zero code (rank 0 turns that into a clear error).
"""

from __future__ import annotations

import datetime
import os
import pickle
import signal
import struct
import sys


def main() -> int:
    rank = int(os.environ["KVFORGE_TP_RANK"])
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    stdin = sys.stdin.buffer
    (n,) = struct.unpack("<Q", stdin.read(8))
    ctx = pickle.loads(stdin.read(n))

    import torch
    import torch.distributed as dist

    from kvforge.distributed.group import destroy_group, init_group
    from kvforge.distributed.launcher import (
        COUNTERS_KEY,
        READY_KEY,
        REPORT_KEY,
        rank_report,
        setup_draft,
        setup_mtp,
        setup_rank,
    )
    from kvforge.distributed.runner import (
        REPORT_COUNTERS,
        RESET_COUNTERS,
        SHARE_TOKENS,
        STEP_DRAFT,
        STEP_MTP,
        STEP_TARGET,
        apply_state_ops,
        broadcast_step,
        run_mtp_call,
    )
    from kvforge.engine.model_runner import ModelRunner

    torch.set_num_threads(ctx["num_threads"])
    timeout = ctx["timeout_s"]
    store = dist.TCPStore("127.0.0.1", ctx["port"], ctx["world_size"], False,
                          timeout=datetime.timedelta(seconds=timeout))
    store.set(READY_KEY.format(rank), "1")
    device = torch.device("cuda", rank) if ctx["backend"] == "nccl" else torch.device("cpu")
    group = init_group(rank, ctx["world_size"], store, ctx["backend"], device, timeout)
    try:
        model, pool, runner = setup_rank(ctx, group)
        _, draft_runner = setup_draft(ctx, group, pool)
        mtp_runner = setup_mtp(ctx, group, pool, runner)
        report = rank_report(rank, model, pool, runner)
    except Exception as e:
        report = {"rank": rank, "error": f"{type(e).__name__}: {e}"}
    store.set(REPORT_KEY.format(rank), pickle.dumps(report))
    if report.get("error"):
        destroy_group()
        return 1
    requests = 0
    n_share = 0  # sampled tokens rank 0 shares after the last target step (async scheduling)
    try:
        with torch.inference_mode():
            while True:
                cmd = stdin.read(1)
                if cmd == REPORT_COUNTERS:
                    requests += 1
                    store.set(COUNTERS_KEY.format(rank, requests), pickle.dumps(runner.counters()))
                    continue
                if cmd == RESET_COUNTERS:
                    for r in (runner, draft_runner):
                        if r is not None:
                            r.reset_counters()
                    continue
                if cmd == SHARE_TOKENS:
                    runner.receive_sampled_tokens(n_share)
                    continue
                if cmd == STEP_MTP:
                    if mtp_runner is None:
                        raise RuntimeError("rank 0 sent a call of the MTP layer but this engine has none")
                    run_mtp_call(mtp_runner, group, pool)
                    continue
                if cmd not in (STEP_TARGET, STEP_DRAFT):  # b"q" or end-of-file (rank 0 is gone)
                    break
                if cmd == STEP_DRAFT and draft_runner is None:
                    raise RuntimeError("rank 0 sent a draft-model step but this engine has no draft model")
                host, copies, use_graph, step_share, state_ops = broadcast_step(group, None, [])
                if copies:  # one pool: the copies of either model's steps apply to every layer
                    pool.copy_blocks(copies)
                if state_ops:  # verification replays and snapshot copies, before this step reads any state slot
                    with torch.inference_mode():
                        apply_state_ops(runner.linear_states, state_ops,
                                        keep=lambda slots, rows: ModelRunner.keep_verified(runner, slots, rows))
                if host.placeholders is not None:  # in-flight ids: from rank 0's last shared tokens
                    host.placeholders = (*host.placeholders[:2], runner.shared_tokens)
                if cmd == STEP_TARGET:
                    runner.execute(host, use_graph)
                    n_share = step_share
                else:
                    draft_runner.execute(host, use_graph)
    except Exception as e:
        print(f"kvforge tensor-parallel worker rank {rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    destroy_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown (seconds with torch loaded); rank 0 waits for this exit
