"""The training loop shared by `recipes/train_causal_lm.py` (torchrun) and `shardpar demo` (local ranks).

Every rank calls `run(options)`; rank 0 prints and writes files. The data-parallel rank picks the
batch (tensor-parallel ranks of one group read the same combined batch: prescaled_batch).
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

import shardpar as smp
from recipes.causal_lm import ckpt, data, models, plot, report
from recipes.causal_lm.options import Options


@dataclass
class RunResult:
    """What `run` returns on every rank (the demo prints rank 0's)."""

    rank: int
    start_step: int
    steps: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)  # mean over ranks, one per step of this run
    tokens_per_s: float = 0.0  # median over this run's steps
    num_params: int = 0
    shard_numel: int = 0  # this rank's sharded elements
    model_state_bytes: int = 0  # measured from live tensors after the first step (this rank)
    estimated_model_state_bytes: int = 0  # shardpar.cli.estimate for the same model and topology
    rss_mib: list[float] = field(default_factory=list)  # peak per rank
    out: str = ""
    metrics: str = ""
    plot: str | None = None
    export: str | None = None
    checkpoint: str | None = None  # newest checkpoint saved by this run
    sample: str | None = None
    notes: list[str] = field(default_factory=list)


@dataclass
class _Job:
    opts: Options
    model: Any
    optimizer: Any
    tokenizer: Any
    tokens: torch.Tensor
    hf_config: Any
    lr: float
    progress: report.Progress
    result: RunResult

    @property
    def is_first(self) -> bool:
        return smp.rank() == 0

    def say(self, text: str) -> None:
        if self.is_first:
            self.progress.message(text)


def run(opts: Options) -> RunResult:
    """Train as `opts` says on this rank (call on every rank); shuts shardpar down afterwards."""
    import transformers

    transformers.logging.set_verbosity_error()
    if not smp.is_initialized():
        smp.init(opts.shardpar_config())
    try:
        if opts.preemption:
            smp.handle_preemption()  # SIGTERM only sets a flag; the loop acts at a step's end
        job = _setup(opts)
        _train(job)
        _finish(job)
        return job.result
    finally:
        smp.stop_handling_preemption()
        smp.shutdown()


# ---- setup ---------------------------------------------------------------------------------------


def _setup(opts: Options) -> _Job:
    out = Path(opts.out)
    progress = report.Progress(opts.steps, mode=opts.progress if smp.rank() == 0 else "none", log_every=opts.log_every)
    texts = data.read_texts(opts.data) if opts.data else data.stdlib_texts()
    tokenizer = data.load_tokenizer(
        opts.tokenizer, texts, opts.vocab_size, out / "tokenizer.json", is_first=smp.rank() == 0, wait=smp.barrier
    )
    tokens = data.encode(tokenizer, texts)
    hf_config = models.hf_config(opts.model, opts.size, vocab_size=data.model_vocab(tokenizer), seq=opts.seq)
    model, optimizer = _build(opts, hf_config)
    result = RunResult(rank=smp.rank(), start_step=0, out=str(out), metrics=str(out / "metrics.jsonl"))
    result.num_params = sum(u.layout.numel for u in model.units) + model.persistent.main.numel()
    result.shard_numel = sum(u.main_shard.numel() for u in model.units)
    lr = opts.lr if opts.lr is not None else models.default_lr(opts.model, opts.size)
    job = _Job(opts, model, optimizer, tokenizer, tokens, hf_config, lr, progress, result)
    if opts.resume:
        content = ckpt.resume(opts.checkpoint_path, opts.resume)
        result.start_step = int(content["step"])
        job.say(f"resumed from {opts.checkpoint_path} ({opts.resume}) at step {result.start_step}")
    elif opts.auto_resume and ckpt.restarted(opts.checkpoint_path):
        # the data order is a function of the step (data.batch), so the step restores it
        content = ckpt.resume_newest(opts.checkpoint_path)
        result.start_step = int(content["step"]) if content is not None else 0
        where = smp.last_resume().get("description", "")
        job.say(f"restarted: resumed from {where} at step {result.start_step} (--no-auto-resume: start over)")
    if job.is_first:
        # every option of this run, loadable with --config (e.g. to --resume it with more --steps)
        out.mkdir(parents=True, exist_ok=True)
        saved = {k: v for k, v in asdict(opts).items() if v is not None and k != "resume"}
        (out / "options.json").write_text(json.dumps(saved, indent=2) + "\n")
    _describe(job, len(texts))
    return job


def _build(opts: Options, hf_config: Any) -> tuple[Any, Any]:
    torch.manual_seed(opts.seed)  # every rank builds the same initial model
    with contextlib.ExitStack() as stack:
        if opts.tp > 1:
            stack.enter_context(smp.tensor_parallelism())
        if opts.delayed_init:
            stack.enter_context(smp.delay_param_initialization())
        module = models.build(hf_config)
    if opts.activation_checkpointing or opts.activation_offloading:
        _enable_checkpointing(module, offload=opts.activation_offloading and smp.device().type == "cuda")
    model = smp.DistributedModel(module, backward_passes_per_step=opts.accum)
    lr = opts.lr if opts.lr is not None else models.default_lr(opts.model, opts.size)
    inner = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=opts.weight_decay)
    optimizer = smp.DistributedOptimizer(inner, dynamic_loss_scale=opts.precision == "fp16")
    return model, optimizer


def _enable_checkpointing(module: Any, *, offload: bool) -> None:
    """Recompute each layer in backward; with `offload` keep the saved layer inputs in host memory
    (on CPU they are there already)."""
    kwargs = {"use_reentrant": False}
    if hasattr(module, "activation_checkpointing_enable"):  # transformers >= 5.2x
        module.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, offload=offload)
    elif offload:
        raise ValueError("--activation-offloading needs transformers with activation_checkpointing_enable(offload=)")
    else:
        module.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _describe(job: _Job, num_texts: int) -> None:
    o, r = job.opts, job.result
    rdp, sdp, tp = smp.rdp_size(), smp.sdp_size(), smp.tp_size()
    per_tp = " per tensor-parallel rank" if tp > 1 else ""
    job.say(
        f"{o.model} {o.size}: {r.num_params:,} parameters{per_tp} | world {smp.size()} "
        f"(sdp {sdp}, tp {tp}, {rdp // sdp} replicas) | {o.precision}"
    )
    vocab = job.tokenizer.get_vocab_size()
    job.say(
        f"data: {num_texts} texts, {job.tokens.numel():,} tokens ({o.tokenizer}, vocab {vocab}) | "
        f"{o.batch * o.seq * o.accum * rdp:,} tokens/step "
        f"(batch {o.batch} x seq {o.seq} x accum {o.accum} x {rdp} data-parallel ranks)"
    )


# ---- the loop ------------------------------------------------------------------------------------


def lr_at(step: int, *, peak: float, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up, then cosine decay to `min_ratio * peak` (step is 0-based)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


@smp.step
def _train_step(model: Any, batch: dict[str, torch.Tensor], scale: float) -> torch.Tensor:
    loss = model(**batch).loss
    model.backward(loss * scale)
    return loss.detach()


def _train(job: _Job) -> None:
    o, model, opt = job.opts, job.model, job.optimizer
    log = report.MetricsLog(Path(job.result.metrics), resume_step=job.result.start_step) if job.is_first else None
    tokens_seen = job.result.start_step * o.batch * o.seq * o.accum * smp.rdp_size()
    model.train()
    for step in range(job.result.start_step, o.steps):
        start = time.perf_counter()
        lr = lr_at(step, peak=job.lr, warmup=o.warmup_steps, total=o.steps, min_ratio=o.min_lr_ratio)
        for group in opt.param_groups:
            group["lr"] = lr
        loss = 0.0
        for micro in range(o.accum):
            b = data.batch(
                job.tokens, seed=o.seed, step=step, micro=micro, rank=smp.rdp_rank(), size=o.batch, seq=o.seq
            )
            loss += float(_train_step(model, b, 1.0 / o.accum).reduce_mean()) / o.accum
        opt.step()
        if step == job.result.start_step:
            job.result.model_state_bytes = model_state_bytes(model, opt)
        opt.zero_grad()
        # the preemption flag rides on the step's all-gather: every rank learns at this same step whether any
        # rank got SIGTERM ([Note: preemption at a step boundary])
        gathered = smp.allgather(
            (loss, report.peak_rss_mib(), report.device_peak_mib(smp.device()), smp.preemption_signalled())
        )
        elapsed = time.perf_counter() - start
        tokens_seen += o.batch * o.seq * o.accum * smp.rdp_size()
        rec = _record(job, step + 1, gathered, lr, elapsed, tokens_seen)
        job.result.steps.append(rec.step)
        job.result.losses.append(rec.loss)
        job.result.rss_mib = rec.rss_mib
        if log is not None:
            log.write(rec)
        job.progress.update(rec)
        saved = bool(o.checkpoint_every) and (rec.step % o.checkpoint_every == 0 or rec.step == o.steps)
        if saved:
            _save(job, rec.step, tokens_seen)
        if o.snapshot_every:  # after the disk save: at a tie the snapshot is the one a restart reads
            ckpt.snapshot(o.checkpoint_path, rec.step, {"step": rec.step, "tokens": tokens_seen})
        if any(g[3] for g in gathered):
            if log is not None:
                log.close()
            _preempted(job, rec.step, tokens_seen, saved)
        if o.async_checkpoints:
            smp.poll_checkpoint()  # commits the background save once every rank's writer is done
    if o.async_checkpoints:
        _commit(job)
    if log is not None:
        log.close()


def _preempted(job: _Job, step: int, tokens: int, saved: bool) -> None:
    """Every rank, at the same step: save (unless this step just did), commit, print one line, exit 143."""
    if not saved:
        _save(job, step, tokens)
    _commit(job)
    smp.exit_preempted(job.result.checkpoint, step, say=job.say if job.is_first else lambda text: None)


def _commit(job: _Job) -> None:
    failure = ckpt.commit(raise_errors=job.opts.checkpoint_errors == "raise")
    if failure:
        _warn(job, f"background checkpoint FAILED, training goes on: {failure}")


def _record(job: _Job, step: int, gathered: list[Any], lr: float, elapsed: float, tokens: int) -> report.StepRecord:
    o, opt = job.opts, job.optimizer
    norm = getattr(opt, "last_grad_norm", None)
    devices = [g[2] for g in gathered]
    return report.StepRecord(
        step=step,
        loss=sum(g[0] for g in gathered) / len(gathered),
        lr=lr,
        grad_norm=float(norm) if norm is not None else None,
        step_time_s=elapsed,
        tokens_per_s=o.batch * o.seq * o.accum * smp.rdp_size() / elapsed,
        tokens=tokens,
        rss_mib=[round(g[1], 1) for g in gathered],
        device_mib=[round(d, 1) for d in devices] if all(d is not None for d in devices) else None,
        loss_scale=opt.loss_scaler.loss_scale if o.precision == "fp16" else None,
    )


def _save(job: _Job, step: int, tokens: int) -> None:
    try:
        path = ckpt.save(
            job.opts.checkpoint_path,
            f"step{step}",
            model=job.model,
            optimizer=job.optimizer,
            user_content={"step": step, "tokens": tokens},
            keep=job.opts.keep_checkpoints,
            background=job.opts.async_checkpoints,
        )
    except ValueError as err:  # an unsupported setup is refused on every rank before anything is written
        job.say(f"checkpoint step {step} skipped: {err}")
        return
    except Exception as err:  # the checkpoint code raises on every rank alike
        if job.opts.checkpoint_errors == "raise":
            raise
        _warn(job, f"checkpoint step {step} FAILED, training goes on: {type(err).__name__}: {err}")
        return
    job.result.checkpoint = str(path)
    job.say(f"checkpoint step {step} -> {path}")


def _warn(job: _Job, text: str) -> None:
    job.result.notes.append(text)
    job.say(text.splitlines()[0])


def model_state_bytes(model: Any, optimizer: Any) -> int:
    """Bytes of the distinct storages the model and optimizer keep (views of one buffer count once):
    original parameters and grads, buffers, unit shards and main grads, persistent copies, and the
    optimizer's parameters, grads and state."""
    tensors: list[Any] = []
    for p in model.module.parameters():
        tensors += [p.data, p.grad]
    tensors += list(model.module.buffers())
    for u in model.units:
        tensors += [u.main_shard, u.main_grad, getattr(u, "_full", None), getattr(u, "_compute_shard", None)]
        replica = getattr(u, "replica", None)  # shard_optimizer_state: this rank's piece
        if replica is not None:
            tensors += [replica.main, replica.main_grad]
    tensors += [model.persistent.main, model.persistent.compute, model.persistent.main_grad]
    for group in optimizer.param_groups:
        for p in group["params"]:
            tensors += [p, p.grad]
    for state in optimizer.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


# ---- the end -------------------------------------------------------------------------------------


def _finish(job: _Job) -> None:
    o, r = job.opts, job.result
    r.estimated_model_state_bytes = _estimated_model_states(job)
    if r.steps:
        r.tokens_per_s = sorted(_tokens_per_s(job))[len(r.steps) // 2]
    if job.is_first and r.steps:
        r.plot = str(_plot(Path(r.metrics), Path(o.out) / "loss.png"))
    if o.export:
        r.export = _export(job)
    if o.sample_tokens > 0:
        r.sample = _sample(job)
    if job.is_first:
        (Path(o.out) / "run.json").write_text(json.dumps({"options": asdict(o), "result": asdict(r)}, indent=2) + "\n")


def _tokens_per_s(job: _Job) -> list[float]:
    per_step = job.opts.batch * job.opts.seq * job.opts.accum * smp.rdp_size()
    if not job.is_first:
        return [0.0] * len(job.result.steps)
    recs = [x for x in report.read_metrics(Path(job.result.metrics)) if x["step"] > job.result.start_step]
    return [per_step / x["step_time_s"] for x in recs] or [0.0]


def _estimated_model_states(job: _Job) -> int:
    from shardpar.cli import estimate

    cfg = smp.get_config()
    shape = estimate.shape_from_hf_config(job.hf_config, persistence_threshold=cfg.sdp_param_persistence_threshold)
    setup = estimate.Setup(
        sdp=smp.sdp_size(), tp=smp.tp_size(), precision=job.opts.precision, device="cpu",
        shard_optimizer_state=cfg.shard_optimizer_state, world=smp.size(),
    )  # fmt: skip
    return estimate.estimate(shape, setup).model_states


def _plot(metrics: Path, path: Path) -> Path:
    recs = report.read_metrics(metrics)
    steps, losses = [x["step"] for x in recs], [x["loss"] for x in recs]
    plot.loss_curve(path, steps, losses, report.smooth(losses, max(1, len(losses) // 15)))
    return path


def _export(job: _Job) -> str | None:
    try:
        path = ckpt.export(Path(job.opts.out) / "export", "final", model=job.model)
    except ValueError as err:
        job.say(f"Hugging Face export skipped: {err}")
        return None
    except Exception as err:
        if job.opts.checkpoint_errors == "raise":
            raise
        _warn(job, f"Hugging Face export FAILED: {type(err).__name__}: {err}")
        return None
    if path is not None and job.is_first:
        _save_tokenizer(job.tokenizer, path)
    smp.barrier()
    return str(path) if path is not None else None


def _save_tokenizer(tokenizer: Any, path: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=data.EOT, pad_token=data.EOT)
    fast.save_pretrained(str(path))


def _sample(job: _Job) -> str:
    """Generate on every rank (each forward is collective); same seed, same weights, same tokens."""
    ids = job.tokenizer.encode(job.opts.prompt).ids or [job.tokenizer.token_to_id(data.EOT)]
    prompt = torch.tensor([ids], device=smp.device())
    job.model.eval()
    torch.manual_seed(job.opts.seed)
    with torch.no_grad():
        out = job.model.generate(
            prompt,
            max_new_tokens=job.opts.sample_tokens,
            min_new_tokens=job.opts.sample_tokens,  # no early stop: every rank runs the same forwards
            do_sample=True,
            top_k=40,
            temperature=0.8,
            pad_token_id=job.tokenizer.token_to_id(data.EOT),
        )
    job.model.train()
    return str(job.opts.prompt + job.tokenizer.decode(out[0, len(ids) :].tolist()))
