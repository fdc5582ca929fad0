"""Start a tensor-parallel engine: this process becomes rank 0 and returns the engine; ranks
1..N-1 are spawned processes that load their shards and follow rank 0's steps.

    engine = start_tp_engine(model_dir, EngineConfig(tensor_parallel_size=2))
    ...  # add_request / step as with LLMEngine (slora_core.launch.start_engine picks)
    engine.close()
"""

from __future__ import annotations

import faulthandler
import logging
import multiprocessing as mp
import os
import signal
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from slora_core.config import ConfigError, EngineConfig, ModelConfig
from slora_core.process import die_with_parent, share_cpu_threads
from slora_core.tokenizer import Tokenizer
from slora_core.tp.engine import TPEngine
from slora_core.tp.group import TPGroup
from slora_core.tp.shard import TPShard
from slora_core.tp.weights import RandomWeights, load_model_shard, random_model_shard

log = logging.getLogger(__name__)


def start_tp_engine(model_dir: str | Path | RandomWeights, config: EngineConfig, *,
                    detokenize: bool = True, timeout_s: float = 600.0,
                    stall_dump_s: float | None = None) -> TPEngine:
    """Rank 0's engine over `config.tensor_parallel_size` ranks (one GPU each on CUDA: rank r
    uses cuda:r). `model_dir` may be `RandomWeights` instead: every rank makes its shard of
    that random model on its device, and the engine has no tokenizer. A collective that waits
    longer than `timeout_s` (a rank died) raises. The ranks run eagerly (no CUDA graphs).
    `stall_dump_s`: ranks > 0 print every thread's stack when one message from rank 0 takes
    that long (TPEngine.serve); they always print it on SIGUSR1. Set SLORA_TP_DEBUG=1 for a
    log line per adapter or arena message on every rank."""
    size = config.tensor_parallel_size
    # Refuse what TPEngine would refuse before any process starts.
    TPShard(_model_config(model_dir), 0, size)
    if config.async_steps:
        raise ConfigError("async_steps is not supported with tensor_parallel_size > 1")
    rendezvous = Path(tempfile.mkdtemp(prefix="slora-tp-")) / "rendezvous"
    init_method = rendezvous.as_uri()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_serve_rank, daemon=True,
                         args=(rank, model_dir, config, init_method, timeout_s,
                               os.getpid(), stall_dump_s))
             for rank in range(1, size)]
    for proc in procs:
        proc.start()
    try:
        engine = _rank_engine(0, model_dir, config, init_method, timeout_s, detokenize)
    except BaseException:
        for proc in procs:  # they would wait for rank 0's first message until the timeout
            proc.kill()
            proc.join()
        TPGroup(0, size).leave(timeout_s=5.0)
        raise
    engine.worker_processes = procs
    return engine


def _model_config(source: str | Path | RandomWeights) -> ModelConfig:
    return source.config if isinstance(source, RandomWeights) else ModelConfig.from_hf_dir(source)


def _rank_engine(rank: int, source: str | Path | RandomWeights, config: EngineConfig,
                 init_method: str, timeout_s: float, detokenize: bool) -> TPEngine:
    share_cpu_threads(config.tensor_parallel_size)
    device = config.device
    if torch.device(device).type == "cuda":
        # Before the group is joined: NCCL binds each rank to the current device.
        device = f"cuda:{rank}"
        torch.cuda.set_device(rank)
        config = replace(config, device=device)
    log.info("rank %d: joining the group on %s", rank, device)
    group = TPGroup.join(rank, config.tensor_parallel_size, init_method, device, timeout_s)
    log.info("rank %d: joined; making its shard", rank)
    shard = TPShard(_model_config(source), rank, group.size)
    tokenizer = None
    if isinstance(source, RandomWeights):
        model = random_model_shard(source, shard, config.torch_dtype, device, group)
    else:
        model = load_model_shard(source, shard, config.torch_dtype, device, group)
        tokenizer = Tokenizer.from_dir(source) if rank == 0 else None
    engine = TPEngine(model, shard, group, tokenizer, config,
                      detokenize=detokenize and rank == 0)
    log.info("rank %d: engine ready", rank)
    return engine


def _serve_rank(rank: int, model_dir: str | Path | RandomWeights, config: EngineConfig,
                init_method: str, timeout_s: float, rank0_pid: int,
                stall_dump_s: float | None) -> None:
    die_with_parent(rank0_pid)
    # This process's own log lines (rank 0's go where its caller configured), to stderr.
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if os.environ.get("SLORA_TP_DEBUG") == "1":
        logging.getLogger("slora_core.tp").setLevel(logging.DEBUG)
    # `kill -USR1 <pid>` prints where every thread of a stuck rank is (a blocked collective
    # or host copy gives no traceback of its own).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    code = 1
    try:
        _rank_engine(rank, model_dir, config, init_method, timeout_s,
                     detokenize=False).serve(stall_dump_s)
        log.info("rank %d: stopped by rank 0; leaving the group", rank)
        code = 0
    except BaseException:
        # Reported before leaving: a leave that waits for rank 0 must not hide why.
        log.exception("tensor-parallel rank %d failed", rank)
    finally:
        TPGroup(rank, config.tensor_parallel_size).leave(timeout_s=30.0 if code == 0 else 5.0)
        sys.stdout.flush()
        sys.stderr.flush()
        # No interpreter teardown: a group that could not be destroyed can hang it.
        os._exit(code)


