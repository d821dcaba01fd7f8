"""Rank 0's side of tensor parallelism: start the workers, check them, watch them.

Startup: a TCPStore on 127.0.0.1 (free port), one ``python -m
kvforge.distributed.worker`` process per rank 1..N-1 (environment inherited,
``NCCL_NVLS_ENABLE=0``), the startup context pickled over the worker's stdin,
then the process group. Every rank builds its model slice, loads its shards
and allocates its KV pool from the same KVPlan; with a draft model
(speculative method draft_model) every rank also builds the draft's slice by
the same tensor-parallel rules and a runner over the draft's layers of its
pool (the plan's ``draft_runner_plan``). The workers report their pool bytes
and KV heads (the draft's too), and rank 0 asserts them against the plan.

After startup each worker's stdin is its wake-up line: one byte per step
(``s`` the target's, ``d`` the draft's), ``t`` for rank 0's sampled tokens
(async scheduling), ``c`` to publish its step counters in the store (graph /
eager steps), ``q`` to quit; end-of-file (rank 0 gone) also ends it. The step
data itself goes over torch.distributed.

Failure handling: a watchdog thread polls the worker processes; a step checks
them before waking them, so a dead worker is reported at the next step. A
worker that dies during a step breaks the gloo collective at once; a worker
that hangs is caught by the collective timeout (``distributed_timeout_s``).
Either way the engine raises :class:`DistributedError` naming the rank, its
pid and how it ended, and refuses further steps.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import struct
import subprocess
import sys
import threading
import time
import weakref

import torch
import torch.distributed as dist

from kvforge.distributed.group import DistributedError, destroy_group, init_group

logger = logging.getLogger("kvforge.distributed")
READY_KEY = "kvforge_ready_{}"
REPORT_KEY = "kvforge_report_{}"
COUNTERS_KEY = "kvforge_counters_{}_{}"  # rank, request number


def describe_exit(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def expected_state_bytes(plan) -> dict[int, int]:
    """Linear-attention layer -> the plan's state bytes per slot on each rank (its share of the heads), verify
    rows included (speculative decoding)."""
    return {lp.index: lp.state_bytes + lp.verify_replay_bytes for lp in plan.layers if lp.kind == "state"}


def expected_pool_bytes(plan) -> int:
    """The pool bytes of every rank: the attention pages plus, with linear-attention layers, the state slots."""
    group = next(g for g in plan.groups if g.kind in ("full", "sliding", "mla"))
    slots = plan.capacity.state_slots or 0
    return plan.num_blocks * plan.group_size * group.page_bytes + slots * sum(expected_state_bytes(plan).values())


def state_slot_bytes(pool) -> dict[int, int]:
    """Linear-attention layer -> the bytes one slot of ``pool`` holds (conv + recurrent state, and the verify
    rows with speculative decoding)."""
    ls = pool.linear_states
    if ls is None:
        return {}
    rows = {i: v.bytes_per_slot for i, v in (ls.verify or {}).items()}
    return {i: (ls.conv[i][0].nbytes + ls.recurrent[i][0].nbytes + rows.get(i, 0)) for i in sorted(ls.conv)}


def _kv_heads(caches) -> list[int]:
    # an MLA cache [blocks, block_size, latent + rope] is one replicated "KV head"
    return [int(c.shape[2]) if c.dim() == 5 else 1 for c in caches if c is not None]


def expected_kv_heads(layers) -> list[int]:
    """The plan's KV heads per rank of each paged layer (target or draft ``LayerPlan``s), in index order."""
    return [lp.kv_heads_per_rank for lp in sorted(layers, key=lambda lp: lp.index)
            if lp.kind in ("full", "sliding", "mla")]


def rank_report(rank: int, model, pool, runner=None) -> dict:
    report = {"rank": rank, "pid": os.getpid(), "nbytes": pool.nbytes,
              "kv_heads": _kv_heads(pool.kv_caches), "draft_kv_heads": _kv_heads(getattr(pool, "draft_kv_caches", [])),
              "state_slots": int(pool.state_slots), "state_bytes": state_slot_bytes(pool),
              "heads": int(model.args.num_heads), "model_kv_heads": int(getattr(model.args, "num_kv_heads", 1)),
              "kv_start": int(model.kv_start)}
    if runner is not None:
        c = runner.counters()
        report.update(graph_sizes=c["graph_sizes"], graph_capture_seconds=c["graph_capture_seconds"],
                      graphs_off_reason=c["graphs_off_reason"])
    return report


#: Extra ``ModelRunner`` keyword arguments every rank's runner gets (empty in production; tests set
#: ``static_decode_on_cpu`` here so the workers run the graph path's static inputs on CPU too).
RUNNER_OPTIONS: dict = {}


def setup_rank(ctx: dict, group):
    """Model slice, weights, KV pool and runner of this rank (same code on every rank)."""
    from kvforge.distributed.runner import TPModelRunner
    from kvforge.distributed.tp_models import build_tp_model
    from kvforge.engine.kv_pool import KVPool
    from kvforge.engine.llm_engine import TORCH_DTYPES
    from kvforge.weights import load_weights

    args, plan = ctx["args"], ctx["plan"]
    if group.device.type == "cuda":  # this rank's GPU holds its share of the plan, checked before weights
        from kvforge.engine.device_memory import check_device_memory

        check_device_memory(plan, group.device, kv_from_flag=args.kv_cache_memory is not None,
                            utilization=args.gpu_memory_utilization, planned_device_bytes=args.gpu_memory)
    torch.manual_seed(args.seed)
    model = build_tp_model(ctx["hf_config"], TORCH_DTYPES[ctx["model_dtype"]], group.device, group, plan,
                           with_mtp=ctx.get("with_mtp", False))
    load_weights(model, ctx["model_path"], ctx["load_format"], seed=args.seed,
                 progress=args.progress and group.rank == 0)
    layouts = getattr(model, "linear_state_layouts", None)  # this rank's heads of each linear-attention layer
    pool = KVPool(plan, group.device, layouts() if layouts is not None else None)
    runner = TPModelRunner(model, pool, plan, group.device, group, calibrate=args.calculate_kv_scales,
                           scale_multiplier=args.kv_scale_multiplier, enforce_eager=args.enforce_eager,
                           max_num_seqs=args.max_num_seqs, mla_prefill_mode=args.mla_prefill_mode,
                           graph_sizes=args.graph_sizes(), **ctx.get("runner_options", {}))
    return model, pool, runner


def setup_draft(ctx: dict, group, pool):
    """The draft model's slice of this rank (the target's tensor-parallel rules, the draft's heads per rank
    from the plan) with its weights, and a runner over its layers of ``pool``; ``(None, None)`` without a
    draft (same code on every rank)."""
    draft = ctx.get("draft")
    if draft is None:
        return None, None
    from kvforge.distributed.runner import STEP_DRAFT, TPModelRunner
    from kvforge.distributed.tp_models import build_tp_model
    from kvforge.engine.llm_engine import TORCH_DTYPES
    from kvforge.weights import load_weights

    args, plan = ctx["args"], ctx["plan"].draft_runner_plan()
    model = build_tp_model(draft["hf_config"], TORCH_DTYPES[ctx["model_dtype"]], group.device, group, plan)
    load_weights(model, draft["model_path"], draft["load_format"], seed=args.seed,
                 progress=args.progress and group.rank == 0)
    runner = TPModelRunner(model, pool.draft_view(), plan, group.device, group, calibrate=args.calculate_kv_scales,
                           scale_multiplier=args.kv_scale_multiplier, enforce_eager=args.enforce_eager,
                           max_num_seqs=args.max_num_seqs, mla_prefill_mode=args.mla_prefill_mode,
                           graph_sizes=args.graph_sizes(), step_command=STEP_DRAFT,
                           **ctx.get("runner_options", {}))
    return model, runner


def setup_mtp(ctx: dict, group, pool, runner):
    """A runner of the model's MTP layer over the proposer layer of ``pool``, linked to ``runner`` (the
    target's), with speculative method mtp; None otherwise (same code on every rank)."""
    if not ctx.get("with_mtp"):
        return None
    from kvforge.distributed.runner import STEP_MTP, TPModelRunner

    args = ctx["args"]
    mtp = TPModelRunner(runner.model, pool.draft_view(), ctx["plan"].draft_runner_plan(), group.device, group,
                        calibrate=args.calculate_kv_scales, scale_multiplier=args.kv_scale_multiplier,
                        enforce_eager=True, max_num_seqs=args.max_num_seqs, mla_prefill_mode=args.mla_prefill_mode,
                        step_command=STEP_MTP, **ctx.get("runner_options", {}))
    mtp.link_mtp(runner)
    return mtp


def rank_threads(threads: int, world_size: int, backend: str) -> int:
    """Intra-op threads each rank runs with: on CPU (gloo) the process's threads shared among the ranks, which
    all run at once on the same cores (each with all of them would oversubscribe every core ``world_size``
    times); on GPUs each rank keeps them all (the host threads only launch kernels)."""
    return max(1, threads // world_size) if backend == "gloo" else threads


class TPLauncher:
    """Owns the worker processes and the process group of one TP engine (on rank 0)."""

    def __init__(self, args, plan, hf_config: dict, model_dtype: str, device: torch.device,
                 model_path: str | None, load_format: str, draft: dict | None = None, with_mtp: bool = False):
        """``draft``: the draft model of speculative method draft_model (``hf_config``, ``model_path``,
        ``load_format``), built on every rank beside the target (:attr:`draft_model`, :attr:`draft_runner`);
        ``with_mtp``: the checkpoint's MTP layer (speculative method mtp) on every rank, run by
        :attr:`draft_runner`."""
        from kvforge.distributed.tp_models import check_tp_architecture, check_tp_split

        self.closed = True  # nothing to shut down until the workers start
        # (LLMEngine has just collected engines dropped without shutdown(), whose groups their finalizers left.)
        if dist.is_initialized():  # another engine's group: refused before anything starts, and left alone
            raise DistributedError("this process already has a torch.distributed process group (another "
                                   "tensor-parallel engine's); run one tensor-parallel engine per process, or "
                                   "call shutdown() on the other one first")
        check_tp_architecture(hf_config)  # before any process starts
        if draft is not None:
            from kvforge.errors import ConfigError

            try:
                check_tp_architecture(draft["hf_config"])
            except ConfigError as e:
                raise ConfigError(f"the draft model (--speculative-config method draft_model): {e}; use a draft of "
                                  f"one of these families or method ngram") from None
        check_tp_split(hf_config, plan)
        if draft is not None:
            try:
                check_tp_split(draft["hf_config"], plan.draft_runner_plan())
            except ConfigError as e:
                raise ConfigError(f"the draft model (--speculative-config method draft_model): {e}") from None
        self.draft_model = self.draft_runner = None
        tp = args.tensor_parallel_size
        self.world_size = tp
        self.timeout_s = float(args.distributed_timeout_s)
        self.procs: list[subprocess.Popen] = []
        self.broken: str | None = None
        self.closed = False
        self._group_joined = [False]  # whether this engine joined (and so owns) the process group (shared
        # with the finalizer below, which must not hold the launcher)
        self._threads_before = torch.get_num_threads()  # given back at shutdown
        self._counter_requests = 0
        self._stop = threading.Event()
        backend = "nccl" if device.type == "cuda" else "gloo"
        if backend == "nccl":
            if torch.cuda.device_count() < tp:
                from kvforge.errors import ConfigError

                raise ConfigError(f"--tensor-parallel-size {tp} needs {tp} GPUs; torch sees "
                                  f"{torch.cuda.device_count()}")
            device = torch.device("cuda", 0)
        os.environ["NCCL_NVLS_ENABLE"] = "0"
        self.device = device
        threads = rank_threads(self._threads_before, tp, backend)
        torch.set_num_threads(threads)
        ctx = dict(args=args, plan=plan, hf_config=hf_config, model_dtype=model_dtype, model_path=model_path,
                   load_format=load_format, backend=backend, world_size=tp, timeout_s=self.timeout_s,
                   num_threads=threads, runner_options=dict(RUNNER_OPTIONS), draft=draft, with_mtp=with_mtp)
        import datetime

        self.store = dist.TCPStore("127.0.0.1", 0, tp, True, timeout=datetime.timedelta(seconds=self.timeout_s),
                                   wait_for_workers=False)
        ctx["port"] = self.store.port
        blob = pickle.dumps(ctx)
        # A launcher dropped without shutdown() (and one alive at interpreter exit) takes its workers, its
        # watchdog and its process group with it; the watchdog holds it only weakly, so it can be dropped.
        self._abandon = weakref.finalize(self, _abandon, self.procs, self._stop, self._group_joined)
        try:
            for rank in range(1, tp):
                env = dict(os.environ, NCCL_NVLS_ENABLE="0", KVFORGE_TP_RANK=str(rank))
                proc = subprocess.Popen([sys.executable, "-m", "kvforge.distributed.worker"],
                                        stdin=subprocess.PIPE, env=env)
                self.procs.append(proc)
                proc.stdin.write(struct.pack("<Q", len(blob)) + blob)
                proc.stdin.flush()
            self._wait_for(READY_KEY, "start")
            self._group_joined[0] = True
            self.group = init_group(0, tp, self.store, backend, device, self.timeout_s)
            self._watchdog = threading.Thread(target=_watch_workers, args=(weakref.ref(self), self._stop),
                                              name="kvforge-tp-watchdog", daemon=True)
            self._watchdog.start()
            self.model, self.pool, self.runner = setup_rank(ctx, self.group)
            self.draft_model, self.draft_runner = setup_draft(ctx, self.group, self.pool)
            if with_mtp:
                self.draft_runner = setup_mtp(ctx, self.group, self.pool, self.runner)
            # Startup reports go through the store (startup deadline), not a collective (step timeout).
            self._wait_for(REPORT_KEY, "load its weights and allocate its KV pool")
            self.reports = [rank_report(0, self.model, self.pool, self.runner)] + [
                pickle.loads(self.store.get(REPORT_KEY.format(r))) for r in range(1, tp)]
            self._check_reports(plan)
            self.runner.control = self
            if self.draft_runner is not None:
                self.draft_runner.control = self
                self.runner.link_draft(self.draft_runner)
        except BaseException:
            self.shutdown()
            raise

    # ---- startup ----------------------------------------------------------------
    def _wait_for(self, key: str, what: str) -> None:
        """Wait until every worker has set ``key`` in the store, failing fast if one exits."""
        startup_s = max(self.timeout_s, 300.0)  # importing torch / reading weights is slow on a busy host
        deadline = time.monotonic() + startup_s
        waiting = set(range(1, self.world_size))
        while waiting:
            for rank in sorted(waiting):
                proc = self.procs[rank - 1]
                if self.store.check([key.format(rank)]):
                    waiting.discard(rank)
                elif proc.poll() is not None:
                    raise DistributedError(f"tensor-parallel worker rank {rank} (pid {proc.pid}) "
                                           f"{describe_exit(proc.returncode)} during startup (see its stderr above)")
            if waiting and time.monotonic() > deadline:
                raise DistributedError(f"tensor-parallel worker rank(s) {sorted(waiting)} did not {what} within "
                                       f"{startup_s:g} s")
            time.sleep(0.02)

    def _check_reports(self, plan) -> None:
        errors = [f"rank {r['rank']}: {r['error']}" for r in self.reports if r.get("error")]
        if errors:
            raise DistributedError("tensor-parallel startup failed on " + "; ".join(errors))
        want_bytes = expected_pool_bytes(plan)
        want_heads = expected_kv_heads(plan.layers)
        has_draft = self.draft_model is not None  # a draft model's slice (an MTP layer is the target's)
        want_draft_heads = expected_kv_heads(plan.draft.layers) if has_draft else []
        for r in self.reports:
            if r["nbytes"] != want_bytes or r["kv_heads"] != want_heads:
                raise DistributedError(
                    f"rank {r['rank']} allocated {r['nbytes']} KV bytes with KV heads per layer {r['kv_heads']}; "
                    f"the plan states {want_bytes} bytes (num_blocks {plan.num_blocks} x group size "
                    f"{plan.group_size} x page bytes) and KV heads {want_heads}")
            if has_draft and r["draft_kv_heads"] != want_draft_heads:
                raise DistributedError(
                    f"rank {r['rank']} holds KV heads {r['draft_kv_heads']} per draft layer; the plan states "
                    f"{want_draft_heads}")
        want_state = expected_state_bytes(plan)
        for r in self.reports:
            if r["state_bytes"] != want_state or r["state_slots"] != (plan.capacity.state_slots or 0) * bool(want_state):
                raise DistributedError(
                    f"rank {r['rank']} allocated {r['state_slots']} state slots of {r['state_bytes']} bytes per "
                    f"linear-attention layer; the plan states {plan.capacity.state_slots} slots of {want_state}")
        sizes = [r.get("graph_sizes") for r in self.reports]
        if any(s != sizes[0] for s in sizes):
            raise DistributedError(f"ranks captured different CUDA-graph batch sizes {sizes} (every rank must "
                                   f"replay the same graphs); use --enforce-eager")
        logger.info("tensor parallel: %d ranks, each %d KV bytes, KV heads per rank %d (first heads %s), "
                    "decode CUDA graphs %s", self.world_size, want_bytes, want_heads[0],
                    [r["kv_start"] for r in self.reports],
                    f"for batch sizes {sizes[0]}" if sizes[0] else f"off ({self.reports[0].get('graphs_off_reason')})")

    # ---- counters -----------------------------------------------------------------
    def rank_counters(self, timeout_s: float = 30.0) -> list[dict]:
        """Every rank's step counters (``num_graph_steps``, ``num_eager_steps``, graph sizes), rank 0 first.
        Call between steps, from the thread that runs them."""
        from kvforge.distributed.runner import REPORT_COUNTERS

        if self.closed or self.broken:
            raise DistributedError(self.broken or "this tensor-parallel engine was shut down")
        self._counter_requests += 1
        n = self._counter_requests
        self._send_to_workers(REPORT_COUNTERS)
        deadline = time.monotonic() + timeout_s
        out = [self.runner.counters()]
        for rank in range(1, self.world_size):
            key = COUNTERS_KEY.format(rank, n)
            while not self.store.check([key]):
                if self.procs[rank - 1].poll() is not None or time.monotonic() > deadline:
                    raise DistributedError(f"tensor-parallel worker rank {rank} did not report its counters")
                time.sleep(0.01)
            out.append(pickle.loads(self.store.get(key)))
        return out

    def reset_worker_counters(self) -> None:
        """The other ranks' step counters (target and draft runners) back to zero, at their next command, in
        order with the steps (rank 0's runners are the engine's own). Call between steps."""
        from kvforge.distributed.runner import RESET_COUNTERS

        if self.closed or self.broken:
            raise DistributedError(self.broken or "this tensor-parallel engine was shut down")
        self._send_to_workers(RESET_COUNTERS)

    # ---- steps --------------------------------------------------------------------
    def _dead(self) -> list[tuple[int, subprocess.Popen]]:
        return [(i + 1, p) for i, p in enumerate(self.procs) if p.poll() is not None]

    def _dead_message(self, dead) -> str:
        return "; ".join(f"tensor-parallel worker rank {rank} (pid {p.pid}) {describe_exit(p.returncode)}"
                         for rank, p in dead) + "; the engine cannot continue (restart it)"

    def _check_workers(self) -> bool:
        """The watchdog's look at the workers: records a dead one as the engine's failure (True: stop
        watching)."""
        dead = self._dead()
        if dead and not self.closed and self.broken is None:
            self.broken = self._dead_message(dead)
            logger.error("%s", self.broken)
            return True
        return False

    def before_step(self, command: bytes | None = None) -> None:
        """Raise if any rank is gone; else wake every worker for one step (``command``: the target's
        ``STEP_TARGET``, the default, or the draft's ``STEP_DRAFT``)."""
        from kvforge.distributed.runner import STEP_TARGET

        self._wake(STEP_TARGET if command is None else command)

    def before_share(self) -> None:
        """Wake every worker for the sampled tokens rank 0 broadcasts next (async scheduling)."""
        from kvforge.distributed.runner import SHARE_TOKENS

        self._wake(SHARE_TOKENS)

    def _wake(self, command: bytes) -> None:
        if self.closed:
            raise DistributedError("this tensor-parallel engine was shut down")
        dead = self._dead()
        if dead:
            self.broken = self._dead_message(dead)
        if self.broken:
            raise DistributedError(self.broken)
        self._send_to_workers(command)

    def _send_to_workers(self, command: bytes) -> None:
        """Write a one-byte command to every worker's stdin (a broken pipe becomes the engine's failure)."""
        try:
            for p in self.procs:
                p.stdin.write(command)
                p.stdin.flush()
        except OSError as e:
            raise self.failure(e) from e

    def failure(self, exc: BaseException) -> DistributedError:
        """A clear error for a failed step (and mark the engine unusable)."""
        if isinstance(exc, DistributedError):
            self.broken = self.broken or str(exc)
            return exc
        deadline = time.monotonic() + 1.0  # a killed peer breaks the socket slightly before its exit status
        while not self._dead() and time.monotonic() < deadline:
            time.sleep(0.05)
        dead = self._dead()
        if dead:
            self.broken = self._dead_message(dead)
        else:
            self.broken = (f"a tensor-parallel collective failed or timed out (timeout {self.timeout_s:g} s) while "
                           f"every worker process is alive (a rank hung?): {type(exc).__name__}: {exc}; "
                           f"the engine cannot continue (restart it)")
        logger.error("%s", self.broken)
        return DistributedError(self.broken)

    # ---- shutdown -------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the workers (politely, then by SIGKILL) and leave the process group. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self._stop.set()
        for p in self.procs:
            if self.broken is not None:
                p.kill()  # the group is unusable: do not wait for a worker that may be hung
            try:
                p.stdin.write(b"q")
                p.stdin.close()
            except OSError:
                pass
        deadline = time.monotonic() + 5.0
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self._group_joined[0]:
            destroy_group()
        self._abandon.detach()
        torch.set_num_threads(self._threads_before)


    def release(self) -> None:
        """Drop rank 0's model, pool and runner (after ``ModelRunner.release``) and the runner's link
        back to this launcher, so nothing here keeps device memory alive. Call after :meth:`shutdown`."""
        for runner in (getattr(self, "runner", None), getattr(self, "draft_runner", None)):
            if runner is not None:
                runner.control = None
        self.model = self.pool = self.runner = self.draft_model = self.draft_runner = None


def _watch_workers(launcher_ref: weakref.ref, stop: threading.Event) -> None:
    """Every 0.2 s until ``stop``, or until the launcher is gone or has recorded a dead worker."""
    while not stop.wait(0.2):
        launcher = launcher_ref()
        if launcher is None or launcher._check_workers():
            return
        del launcher


def _abandon(procs: list[subprocess.Popen], stop: threading.Event, group_joined: list[bool]) -> None:
    """Stop the watchdog, kill the workers and leave the process group (if joined): the end of a launcher
    that was not shut down."""
    stop.set()
    _kill_all(procs)
    for p in procs:
        try:
            p.wait(timeout=5.0)  # reaped, so that nothing outlives the launcher
        except subprocess.TimeoutExpired:
            pass
    if group_joined[0]:
        destroy_group()


def _kill_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
