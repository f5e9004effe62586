"""Schema of ``conf/regenerate.yaml`` (``python -m dflash.data.regenerate``) and its checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from dflash.config import ChatTemplateConfig

SCHEMA_NAME = "dflash_regenerate_schema"
BACKENDS = ("openai", "hf")


@dataclass
class RegenerateConfig:
    input: str = MISSING
    """Chat JSONL ({"messages": [...]}), ShareGPT JSONL ({"conversations": [{"from", "value"}]}) or a
    ``datasets`` path: the formats the training loader reads."""
    split: str = "train"
    """Split of a ``datasets`` input."""
    output: str = MISSING
    """Chat JSONL written append-only, one regenerated record per line (in completion order);
    beside it ``<output>.meta.json`` and ``<output>.failed.jsonl``. Re-running the same command
    resumes it."""
    num_records: int | None = None
    """Regenerate only the first N input records (None = all)."""
    backend: str = "openai"
    """openai (an OpenAI-compatible server) or hf (HF generate in this process)."""
    model: str = MISSING
    """The served model name (openai), or the target's directory or hub id (hf)."""
    endpoint: str | None = None
    """Base URL of the server's OpenAI API, e.g. http://127.0.0.1:8000/v1."""
    endpoints: list[str] = field(default_factory=list)
    """Several base URLs (replicas of the same model): requests go round robin, a retry goes to the next."""
    concurrency: int = 64
    """Records in flight at once (each sends its turns one after the other)."""
    request_timeout_s: float = 600.0
    """Total deadline of one attempt at a request (one assistant turn), however slowly the server
    sends its bytes; a timed-out attempt is retried like a connection error."""
    max_retries: int = 8
    """Retries of a request after a connection error, a timeout, HTTP 429 or 5xx (other errors fail
    at once; HTTP 401/403/404 stop the run)."""
    retry_backoff_s: float = 1.0
    """First retry delay; doubled per retry up to 30 s, with jitter."""
    max_consecutive_failures: int = 32
    """Stop the run (re-run the command later) after this many records in a row failed on request
    errors: the server is down or misconfigured."""
    temperature: float = 0.0
    """0 = greedy, the target's own most likely text (what greedy speculative decoding verifies)."""
    top_p: float | None = None
    """Nucleus sampling threshold (None: the server's default; ignored at temperature 0)."""
    max_tokens: int = 2048
    """Per assistant turn; a turn cut there keeps its text (finish reason ``length``, counted) and
    is marked ``cut_at_max_tokens`` (training does not supervise its end-of-turn token). Also
    bounds a reply: more tokens, more than 32 characters per token or more bytes than that allows
    is rejected."""
    seed: int | None = None
    """Sampling seed sent with each request (temperature > 0)."""
    data: ChatTemplateConfig = field(default_factory=ChatTemplateConfig)
    """``data.chat_template_kwargs``: passed to the chat template (e.g. {enable_thinking: false});
    recorded in meta.json, and training refuses the output unless its data.chat_template_kwargs is
    the same (it must match serving too)."""
    keep_reasoning: bool = True
    """Keep the reasoning a server returns separately (``reasoning_content``/``reasoning``) as the
    message's ``reasoning_content`` (Qwen3-style templates render it), or drop it."""
    extra_body: dict[str, Any] = field(default_factory=dict)
    """More request fields for the server (e.g. {top_k: 20} for vLLM or SGLang)."""
    batch_size: int = 32
    """backend=hf: conversations generated together."""
    device: str = "auto"
    """backend=hf: auto (cuda when available, else cpu), cpu or cuda."""
    dtype: str = "auto"
    """backend=hf: auto (bfloat16 on GPU, float32 on CPU), float32, bfloat16 or float16."""
    progress_bar: bool = True
    """A progress bar of records, requests/s and generated tokens/s."""


def register_regenerate_schema() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=SCHEMA_NAME, node=RegenerateConfig)


def endpoints_of(cfg: RegenerateConfig) -> list[str]:
    """``endpoints``, or ``[endpoint]``; base URLs without a trailing slash."""
    urls = list(cfg.endpoints) or ([cfg.endpoint] if cfg.endpoint else [])
    return [u.rstrip("/") for u in urls]


def config_problems(cfg: RegenerateConfig) -> list[str]:
    """Every problem the config alone shows, each naming the field, the value and the fix."""
    p: list[str] = []
    if cfg.backend not in BACKENDS:
        p.append(f"backend={cfg.backend!r} is not one of {list(BACKENDS)}; set backend=openai or backend=hf")
    if cfg.backend == "openai":
        if cfg.endpoint and cfg.endpoints:
            p.append(
                "endpoint and endpoints are both set; give one server as endpoint=URL or several as endpoints=[URL,...]"
            )
        urls = endpoints_of(cfg)
        if not urls:
            p.append(
                "backend=openai needs a server: set endpoint=http://HOST:PORT/v1 (or endpoints=[...]), or backend=hf"
            )
        for u in urls:
            if not u.startswith(("http://", "https://")):
                p.append(f"endpoint {u!r} is not an http(s) URL; set endpoint=http://HOST:PORT/v1")
    if cfg.concurrency < 1:
        p.append(f"concurrency={cfg.concurrency}: must be >= 1")
    if cfg.request_timeout_s <= 0:
        p.append(f"request_timeout_s={cfg.request_timeout_s}: must be > 0")
    if cfg.max_retries < 0:
        p.append(f"max_retries={cfg.max_retries}: must be >= 0")
    if cfg.retry_backoff_s < 0:
        p.append(f"retry_backoff_s={cfg.retry_backoff_s}: must be >= 0")
    if cfg.max_consecutive_failures < 1:
        p.append(f"max_consecutive_failures={cfg.max_consecutive_failures}: must be >= 1")
    if cfg.temperature < 0:
        p.append(f"temperature={cfg.temperature}: must be >= 0 (0 = greedy)")
    if cfg.top_p is not None and not 0 < cfg.top_p <= 1:
        p.append(f"top_p={cfg.top_p}: must be in (0, 1] or null")
    if cfg.max_tokens < 1:
        p.append(f"max_tokens={cfg.max_tokens}: must be >= 1")
    if cfg.num_records is not None and cfg.num_records < 1:
        p.append(f"num_records={cfg.num_records}: must be >= 1 or null (all)")
    if cfg.batch_size < 1:
        p.append(f"batch_size={cfg.batch_size}: must be >= 1")
    if cfg.device not in ("auto", "cpu", "cuda"):
        p.append(f"device={cfg.device!r} is not one of ['auto', 'cpu', 'cuda']")
    if cfg.dtype not in ("auto", "float32", "bfloat16", "float16"):
        p.append(f"dtype={cfg.dtype!r} is not one of ['auto', 'float32', 'bfloat16', 'float16']")
    if cfg.backend == "hf" and cfg.temperature > 0 and cfg.seed is None:
        p.append(
            "backend=hf with temperature > 0 needs seed=<int> so that a resumed run samples reproducibly"
        )
    return p
