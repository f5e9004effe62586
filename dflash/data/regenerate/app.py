"""``run(cfg)``: regenerate every record of ``cfg.input`` into ``cfg.output`` (see the package docstring).

Accounting, per run: ``written + failed + skipped == records`` (``skipped``: already in the output
from an earlier run; ``failed``: in ``<output>.failed.jsonl`` with the reason: ``malformed`` input,
``rejected`` by the server (HTTP 4xx, e.g. a prompt longer than the model's context) or
``request_error`` (no answer after the retries)). A run stopped early (``max_consecutive_failures``
request errors in a row, or Ctrl-C) also reports the records it did not attempt; re-running the
same command does them, and retries the failed ones.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from dflash.config.checks import raise_problems
from dflash.data.chat import MalformedConversation
from dflash.data.regenerate.config import RegenerateConfig, config_problems, endpoints_of
from dflash.data.regenerate.conversation import Regeneration, Reply
from dflash.data.regenerate.output import RegenOutput, open_output
from dflash.data.sources import Source, parse_messages

log = logging.getLogger(__name__)


@dataclass
class RegenSummary:
    """What one run did (the counts are over the first ``records`` input records)."""

    output: str
    records: int
    skipped: int = 0
    written: int = 0
    failed: dict[str, int] = field(default_factory=dict)
    not_attempted: int = 0
    requests: int = 0
    generated_tokens: int = 0
    turns_cut: int = 0
    """Assistant turns cut at max_tokens (finish reason ``length``)."""
    seconds: float = 0.0
    stopped: str | None = None
    """Why the run stopped before the end, if it did."""

    @property
    def num_failed(self) -> int:
        return sum(self.failed.values())

    @property
    def complete(self) -> bool:
        """Every input record is in the output."""
        return self.skipped + self.written == self.records

    def counts(self) -> dict[str, Any]:
        return {
            "records": self.records,
            "written": self.written,
            "skipped": self.skipped,
            "failed": dict(self.failed),
            "not_attempted": self.not_attempted,
            "requests": self.requests,
            "generated_tokens": self.generated_tokens,
            "turns_cut_at_max_tokens": self.turns_cut,
            "seconds": round(self.seconds, 3),
        }

    def table(self) -> str:
        """The readable end-of-run summary."""
        secs = max(self.seconds, 1e-9)
        failed = ", ".join(f"{k} {v}" for k, v in sorted(self.failed.items())) or "none"
        lines = [
            f"regenerate -> {self.output}",
            f"  records      {self.records}",
            f"  written      {self.written} (this run)",
            f"  skipped      {self.skipped} (already in the output)",
            f"  failed       {self.num_failed} ({failed}; reasons in {self.output}.failed.jsonl)",
        ]
        if self.not_attempted:
            lines.append(f"  not attempted {self.not_attempted} (the run stopped: {self.stopped})")
        lines += [
            f"  check        {self.written} + {self.num_failed} + {self.skipped}"
            + (f" + {self.not_attempted}" if self.not_attempted else "")
            + f" = {self.written + self.num_failed + self.skipped + self.not_attempted} of {self.records} records",
            f"  requests     {self.requests} ({self.requests / secs:.2f}/s), generated tokens "
            f"{self.generated_tokens} ({self.generated_tokens / secs:.1f}/s), turns cut at max_tokens "
            f"{self.turns_cut}, {self.seconds:.1f} s",
            "  complete: every record is in the output"
            if self.complete
            else "  incomplete: re-run the same command to retry the failed records and resume",
        ]
        return "\n".join(lines)


def source_id(record: Any, index: int) -> Any:
    """The record's own ``id`` (a string or an int), else its index in the input."""
    rid = record.get("id") if isinstance(record, dict) else None
    return rid if isinstance(rid, (str, int)) and not isinstance(rid, bool) else index


class _Run:
    """Shared by both backends: starting a record, finishing it, counting, the progress bar."""

    def __init__(self, cfg: RegenerateConfig, out: RegenOutput, summary: RegenSummary, total: int) -> None:
        self.cfg, self.out, self.summary = cfg, out, summary
        self.t0 = time.perf_counter()
        self.bar: Any = None
        if cfg.progress_bar:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="regenerate", unit="rec", dynamic_ncols=True)

    def start(self, idx: int, where: str, record: Any) -> Regeneration | None:
        try:
            return Regeneration(parse_messages(record), keep_reasoning=self.cfg.keep_reasoning)
        except MalformedConversation as exc:
            self.fail(idx, where, record, "malformed", str(exc))
            return None

    def replied(self, reply: Reply) -> None:
        s = self.summary
        s.requests += 1
        s.generated_tokens += reply.completion_tokens
        s.turns_cut += reply.finish_reason == "length"

    def finish(self, idx: int, record: Any, regen: Regeneration) -> None:
        self.out.write(
            {
                "id": source_id(record, idx),
                "source_index": idx,
                "messages": regen.conversation,
                "finish_reasons": [r.finish_reason for r in regen.replies],
            }
        )
        self.summary.written += 1
        self._tick()

    def fail(self, idx: int, where: str, record: Any, reason: str, error: str) -> None:
        self.out.fail(idx, source_id(record, idx), where, reason, error)
        self.summary.failed[reason] = self.summary.failed.get(reason, 0) + 1
        if self.summary.failed[reason] <= 5:
            log.warning("record %d (%s) failed (%s): %s", idx, where, reason, error)
        self._tick()

    def _tick(self) -> None:
        if self.bar is None:
            return
        s, secs = self.summary, max(time.perf_counter() - self.t0, 1e-9)
        self.bar.set_postfix_str(
            f"{s.requests / secs:.2f} req/s, {s.generated_tokens / secs:.0f} tok/s, failed {s.num_failed}",
            refresh=False,
        )
        self.bar.update(1)

    def close(self) -> None:
        self.summary.seconds = time.perf_counter() - self.t0
        if self.bar is not None:
            self.bar.close()


async def _drive_openai(run: _Run, todo: Iterable[tuple[int, str, Any]]) -> None:
    """``concurrency`` records in flight, each sending its turns in order; stops submitting after
    ``max_consecutive_failures`` request errors in a row."""
    from dflash.data.regenerate.openai_client import ChatClient, RequestFailed

    cfg = run.cfg
    sampling: dict[str, Any] = {"temperature": cfg.temperature, "max_tokens": cfg.max_tokens}
    if cfg.top_p is not None:
        sampling["top_p"] = cfg.top_p
    if cfg.seed is not None:
        sampling["seed"] = cfg.seed
    slots = asyncio.Semaphore(cfg.concurrency)
    streak = 0

    async def one(client: ChatClient, idx: int, where: str, record: Any) -> None:
        nonlocal streak
        try:
            regen = run.start(idx, where, record)
            if regen is None:
                return
            while (prompt := regen.prompt) is not None:
                reply = await client.complete(prompt)
                run.replied(reply)
                regen.answer(reply)
        except RequestFailed as exc:
            run.fail(idx, where, record, "request_error" if exc.retryable else "rejected", str(exc))
            streak = streak + 1 if exc.retryable else streak
            if streak >= cfg.max_consecutive_failures and run.summary.stopped is None:
                run.summary.stopped = f"{streak} records in a row failed on request errors; last: {exc}"
            return
        except MalformedConversation as exc:
            run.fail(idx, where, record, "malformed", str(exc))
            return
        finally:
            slots.release()
        streak = 0
        run.finish(idx, record, regen)

    async with ChatClient(
        endpoints_of(cfg),
        cfg.model,
        sampling,
        chat_template_kwargs=dict(cfg.data.chat_template_kwargs),
        extra_body=dict(cfg.extra_body),
        timeout_s=cfg.request_timeout_s,
        max_retries=cfg.max_retries,
        backoff_s=cfg.retry_backoff_s,
        max_connections=cfg.concurrency,
    ) as client:
        tasks: set[asyncio.Task] = set()
        try:
            for idx, where, record in todo:
                await slots.acquire()
                if run.summary.stopped is not None:
                    slots.release()
                    break
                task = asyncio.create_task(one(client, idx, where, record))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def _drive_hf(run: _Run, todo: Iterable[tuple[int, str, Any]]) -> None:
    """``batch_size`` records at a time: turn k of every record of the batch in one ``generate``."""
    import torch

    from dflash.config.resolve import device_kind, torch_dtype
    from dflash.data.regenerate.hf_backend import HFBackend

    cfg = run.cfg
    device = torch.device(device_kind(cfg.device))
    if cfg.seed is not None:
        torch.manual_seed(cfg.seed)
    backend = HFBackend(
        cfg.model,
        device=device,
        dtype=torch_dtype(cfg.dtype, device),
        template_kwargs=dict(cfg.data.chat_template_kwargs),
        max_tokens=cfg.max_tokens,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        batch_size=cfg.batch_size,
    )
    it = iter(todo)
    while group := list(islice(it, cfg.batch_size)):
        live = [
            (idx, where, record, regen)
            for idx, where, record in group
            if (regen := run.start(idx, where, record))
        ]
        while live:
            pending, prompts = [], []
            for item in live:
                try:
                    prompt = item[3].prompt
                except MalformedConversation as exc:
                    run.fail(item[0], item[1], item[2], "malformed", str(exc))
                    continue
                if prompt is None:
                    run.finish(item[0], item[2], item[3])
                else:
                    pending.append(item)
                    prompts.append(prompt)
            live = []
            for item, reply in zip(pending, backend.generate(prompts), strict=True):
                if isinstance(reply, Exception):
                    run.fail(item[0], item[1], item[2], "rejected", f"{type(reply).__name__}: {reply}")
                else:
                    run.replied(reply)
                    item[3].answer(reply)
                    live.append(item)


def _todo(source: Source, count: int, done: set[int]) -> Iterator[tuple[int, str, Any]]:
    for idx, where, record in islice(source.numbered(), count):
        if idx not in done:
            yield idx, where, record


def run(cfg: RegenerateConfig) -> RegenSummary:
    """Regenerate ``cfg.input`` into ``cfg.output`` (resuming it), print the summary, return it.

    Raises ValueError on a config problem (all at once, before any request), an unreadable input,
    or an output that another run holds or that was made with other settings.
    """
    raise_problems(config_problems(cfg), "regenerate config")
    source = Source(cfg.input, cfg.split, field="input")
    count = min(source.num_records, cfg.num_records or source.num_records)
    settings = {
        "input": source.fingerprint,
        "backend": cfg.backend,
        "model": cfg.model,
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "max_tokens": cfg.max_tokens,
        "seed": cfg.seed,
        "chat_template_kwargs": dict(cfg.data.chat_template_kwargs),
        "keep_reasoning": cfg.keep_reasoning,
        "extra_body": dict(cfg.extra_body),
    }
    with open_output(cfg.output, settings) as out:
        done = {i for i in out.done if i < count}
        summary = RegenSummary(output=str(out.path), records=count, skipped=len(done))
        static = {
            "input": str(cfg.input),
            "model": cfg.model,
            "backend": cfg.backend,
            "endpoints": endpoints_of(cfg) if cfg.backend == "openai" else [],
        }
        out.write_meta({**static, "status": "running"})
        if out.torn_bytes:
            log.warning(
                "output %s: dropped a torn last line (%d bytes); that record is redone",
                out.path,
                out.torn_bytes,
            )
        log.info(
            "regenerate: %d records of %s, %d already in %s, backend %s, model %s",
            count,
            cfg.input,
            len(done),
            out.path,
            cfg.backend,
            cfg.model,
        )
        state = _Run(cfg, out, summary, count - len(done))
        status = "interrupted"
        try:
            todo = _todo(source, count, done)
            if cfg.backend == "openai":
                asyncio.run(_drive_openai(state, todo))
            else:
                _drive_hf(state, todo)
            status = "complete" if summary.complete else ("stopped" if summary.stopped else "incomplete")
        finally:
            state.close()
            summary.not_attempted = count - summary.skipped - summary.written - summary.num_failed
            if summary.not_attempted and summary.stopped is None:
                summary.stopped = status
            out.write_meta(
                {**static, "status": status, "counts": summary.counts(), "complete": summary.complete}
            )
            print(summary.table(), flush=True)
    return summary
