"""``run(cfg)``: regenerate every record of ``cfg.input`` into ``cfg.output`` (see the package docstring).

Accounting, per run: ``written + failed + skipped == records`` (``skipped``: already in the output
from an earlier run; ``failed``: in ``<output>.failed.jsonl`` with the reason: ``malformed`` input,
``rejected`` by the server (HTTP 4xx, e.g. a prompt longer than the model's context) or
``request_error`` (no answer after the retries); ``rejected`` also counts every reply that is not a
usable chat completion, with its reason). A run stopped early also reports the records it did not
attempt; re-running the same command does them, and retries the failed ones. How a run ends
(:attr:`RegenSummary.exit_code`, the app's exit status):

- 0: every record is in the output;
- 1: some records failed, or ``max_consecutive_failures`` records in a row failed on request
  errors (the server is down: the run stops submitting);
- ``EXIT_USER_ERROR`` (2): the server refused a request with HTTP 401/403/404 (credentials,
  endpoint URL or model name): the run stops at once, since every request would get the same
  answer (config and input errors also exit 2, before any request);
- ``EXIT_STOPPED`` (75): SIGTERM, SIGINT or SIGHUP; the requests in flight are cancelled and their
  records are redone by the next run.

Each ending prints the summary and writes ``meta.json`` (``status``: complete, incomplete,
stopped, or interrupted by an internal error), with the environment's secrets redacted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from dflash.config import EXIT_STOPPED, EXIT_USER_ERROR
from dflash.config.checks import raise_problems
from dflash.config.secrets import redact
from dflash.data.chat import MalformedConversation
from dflash.data.regenerate.config import RegenerateConfig, config_problems, endpoints_of
from dflash.data.regenerate.conversation import Regeneration, Reply
from dflash.data.regenerate.output import RegenOutput, open_output
from dflash.data.regenerate.stopping import StopSignals
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
    signal: str | None = None
    """The stop signal that ended the run (SIGTERM, SIGINT, SIGHUP), if one did."""
    refused: str | None = None
    """The server's refusal (HTTP 401/403/404) that ended the run, if one did."""

    @property
    def num_failed(self) -> int:
        return sum(self.failed.values())

    @property
    def complete(self) -> bool:
        """Every input record is in the output."""
        return self.skipped + self.written == self.records

    @property
    def exit_code(self) -> int:
        """The app's exit status (see the module docstring)."""
        if self.complete:
            return 0
        if self.refused is not None:
            return EXIT_USER_ERROR
        return EXIT_STOPPED if self.signal is not None else 1

    @property
    def status(self) -> str:
        """``meta.json``'s status: complete, stopped (a signal, a refusal, request errors) or incomplete."""
        return "complete" if self.complete else ("stopped" if self.stopped else "incomplete")

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
        if self.not_attempted or self.stopped:
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
        if self.refused is not None and not self.complete:
            lines[-1] = "  incomplete: fix what the server refused (below), then re-run the same command"
        return redact("\n".join(lines))


def source_id(record: Any, index: int) -> Any:
    """The record's own ``id`` (a string or an int), else its index in the input."""
    rid = record.get("id") if isinstance(record, dict) else None
    return rid if isinstance(rid, (str, int)) and not isinstance(rid, bool) else index


class _Run:
    """Shared by both backends: starting a record, finishing it, counting, the progress bar."""

    def __init__(
        self, cfg: RegenerateConfig, out: RegenOutput, summary: RegenSummary, total: int, stop: StopSignals
    ) -> None:
        self.cfg, self.out, self.summary, self.stop = cfg, out, summary, stop
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

    def finish(self, idx: int, where: str, record: Any, regen: Regeneration) -> None:
        try:
            self.out.write(
                {
                    "id": source_id(record, idx),
                    "source_index": idx,
                    "messages": regen.conversation,
                    "finish_reasons": [r.finish_reason for r in regen.replies],
                }
            )
        except UnicodeEncodeError as exc:  # e.g. a lone surrogate in the record's id or an extra field
            self.fail(
                idx,
                where,
                record,
                "malformed",
                f"the record holds text that is not valid Unicode ({exc.reason})",
            )
            return
        self.summary.written += 1
        self._tick()

    def fail(self, idx: int, where: str, record: Any, reason: str, error: str) -> None:
        self.out.fail(idx, source_id(record, idx), where, reason, error)
        self.summary.failed[reason] = self.summary.failed.get(reason, 0) + 1
        if self.summary.failed[reason] <= 5:
            log.warning("record %d (%s) failed (%s): %s", idx, where, reason, redact(error))
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


class _OpenAIRecords:
    """``concurrency`` records in flight, each sending its turns in order.

    Submitting stops after ``max_consecutive_failures`` records in a row failed on request errors
    (the records in flight finish). A refusal (HTTP 401/403/404) or a stop signal stops at once:
    the records in flight are cancelled (not attempted: the next run does them). An unexpected
    exception in a record stops the run the same way and is raised after it.
    """

    def __init__(self, run: _Run, client: Any) -> None:
        self.run, self.client = run, client
        self.slots = asyncio.Semaphore(run.cfg.concurrency)
        self.streak = 0
        self.tasks: set[asyncio.Task] = set()
        self.errors: list[BaseException] = []

    def halt(self, why: str) -> None:
        """Stop submitting and cancel the records in flight."""
        if self.run.summary.stopped is None:
            self.run.summary.stopped = why
        for task in self.tasks:
            task.cancel()

    async def one(self, idx: int, where: str, record: Any) -> None:
        from dflash.data.regenerate.openai_client import RequestFailed

        try:
            regen = self.run.start(idx, where, record)
            if regen is None:
                return
            while (prompt := regen.prompt) is not None:
                reply = await self.client.complete(prompt)
                self.run.replied(reply)
                regen.answer(reply)
        except RequestFailed as exc:
            self.run.fail(idx, where, record, "request_error" if exc.retryable else "rejected", str(exc))
            if exc.refused:
                self.run.summary.refused = str(exc)
                self.halt(f"the server refused a request: {exc}")
            elif exc.retryable:
                self.streak += 1
                if self.streak >= self.run.cfg.max_consecutive_failures and self.run.summary.stopped is None:
                    self.run.summary.stopped = (
                        f"{self.streak} records in a row failed on request errors; last: {exc}"
                    )
            return
        except MalformedConversation as exc:
            self.run.fail(idx, where, record, "malformed", str(exc))
            return
        finally:
            self.slots.release()
        self.streak = 0
        self.run.finish(idx, where, record, regen)

    def _done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        exc = None if task.cancelled() else task.exception()
        if exc is not None:
            self.errors.append(exc)
            self.halt(f"an internal error: {exc!r}")

    async def drive(self, todo: Iterable[tuple[int, str, Any]]) -> None:
        loop = asyncio.get_running_loop()

        def on_signal() -> None:  # in the signal handler: wake the loop, halt inside it
            loop.call_soon_threadsafe(self.halt, f"{self.run.stop.signal} received")

        unhook = self.run.stop.on_stop(on_signal)
        try:
            for idx, where, record in todo:
                await self.slots.acquire()
                if self.run.summary.stopped is not None or self.run.stop.signal is not None:
                    self.slots.release()
                    break
                task = asyncio.create_task(self.one(idx, where, record))
                self.tasks.add(task)
                task.add_done_callback(self._done)
            while self.tasks:
                await asyncio.wait(set(self.tasks))
        finally:
            unhook()
            for task in self.tasks:
                task.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.errors:
            raise self.errors[0]


async def _drive_openai(run: _Run, todo: Iterable[tuple[int, str, Any]]) -> None:
    """The records through an OpenAI-compatible server (:class:`_OpenAIRecords`)."""
    from dflash.data.regenerate.openai_client import ChatClient

    cfg = run.cfg
    sampling: dict[str, Any] = {"temperature": cfg.temperature, "max_tokens": cfg.max_tokens}
    if cfg.top_p is not None:
        sampling["top_p"] = cfg.top_p
    if cfg.seed is not None:
        sampling["seed"] = cfg.seed
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
        await _OpenAIRecords(run, client).drive(todo)


def _drive_hf(run: _Run, todo: Iterable[tuple[int, str, Any]]) -> None:
    """``batch_size`` records at a time: turn k of every record of the batch in one ``generate``;
    a stop signal ends ``generate`` at its next token and drops that batch (not attempted)."""
    import torch

    from dflash.config.resolve import device_kind, torch_dtype
    from dflash.data.regenerate.hf_backend import GenerationStopped, HFBackend

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
    while run.stop.signal is None and (group := list(islice(it, cfg.batch_size))):
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
                    run.finish(item[0], item[1], item[2], item[3])
                else:
                    pending.append(item)
                    prompts.append(prompt)
            try:
                replies = backend.generate(prompts, should_stop=lambda: run.stop.signal is not None)
            except GenerationStopped:
                return
            live = []
            for item, reply in zip(pending, replies, strict=True):
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


def _settings(cfg: RegenerateConfig, source: Source) -> dict[str, Any]:
    """What the records' content depends on: an output made with other settings is refused."""
    return {
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


def run(cfg: RegenerateConfig) -> RegenSummary:
    """Regenerate ``cfg.input`` into ``cfg.output`` (resuming it), print the summary, return it
    (its ``exit_code`` says how the run ended; a stop signal ends it early, see the module docstring).

    Raises ValueError on a config problem (all at once, before any request), an unreadable input,
    or an output that another run holds or that was made with other settings.
    """
    raise_problems(config_problems(cfg), "regenerate config")
    with StopSignals() as stop:
        source = Source(cfg.input, cfg.split, field="input")
        count = min(source.num_records, cfg.num_records or source.num_records)
        with open_output(cfg.output, _settings(cfg, source)) as out:
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
            state = _Run(cfg, out, summary, count - len(done), stop)
            status = "interrupted"
            try:
                todo = _todo(source, count, done)
                if cfg.backend == "openai":
                    asyncio.run(_drive_openai(state, todo))
                else:
                    _drive_hf(state, todo)
                summary.signal = stop.signal
                if stop.signal is not None and summary.stopped is None:
                    summary.stopped = f"{stop.signal} received"
                status = summary.status
            finally:
                state.close()
                summary.not_attempted = count - summary.skipped - summary.written - summary.num_failed
                if summary.not_attempted and summary.stopped is None:
                    summary.stopped = status
                meta = {**static, "status": status, "counts": summary.counts(), "complete": summary.complete}
                out.write_meta({**meta, "stopped": summary.stopped})
                print(summary.table(), flush=True)
    return summary
