"""Secrets never reach a file the project writes.

A secret is the value (8 characters or more) of an environment variable whose name says it is one
(``WANDB_API_KEY``, ``HF_TOKEN``, ``AWS_SECRET_ACCESS_KEY``, ...). Three defences:
- ``config_secret_problems``: a config field that holds a secret (or interpolates a secret
  variable, ``${oc.env:WANDB_API_KEY}``) is a config error, so no config file can carry one;
- ``redact`` / ``redact_config``: text and configs with every secret value replaced;
- ``SecretFilter``: a logging filter, installed on every handler of every rank, that redacts log
  records (message, arguments and traceback) before any handler writes them.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from typing import Any

REDACTED = "<redacted>"
_SECRET_NAME = re.compile(r"(KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIALS?)$", re.I)
_SECRET_KEY_NAMES = {"api_key", "apikey", "password", "passwd", "secret", "token", "hf_token", "auth_token"}
_MIN_LEN = 8


def secret_env_names(environ: Mapping[str, str] | None = None) -> list[str]:
    """Names of the environment variables that hold a secret (by name, value of 8+ characters)."""
    env = os.environ if environ is None else environ
    return sorted(n for n, v in env.items() if _SECRET_NAME.search(n) and len(v) >= _MIN_LEN)


def secret_values(environ: Mapping[str, str] | None = None) -> list[str]:
    """The secret values of the environment, longest first (so a secret containing another is
    replaced whole)."""
    env = os.environ if environ is None else environ
    return sorted({env[n] for n in secret_env_names(env)}, key=len, reverse=True)


def redact(text: str, secrets: list[str] | None = None) -> str:
    """``text`` with every secret value replaced by ``<redacted>``."""
    for s in secret_values() if secrets is None else secrets:
        text = text.replace(s, REDACTED)
    return text


def _redact_tree(value: Any, secrets: list[str], key: str | None = None) -> Any:
    if key is not None and key.lower() in _SECRET_KEY_NAMES and value not in (None, ""):
        return REDACTED
    if isinstance(value, Mapping):
        return {k: _redact_tree(v, secrets, str(k)) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_redact_tree(v, secrets) for v in value]
    if isinstance(value, str) and any(s in value for s in secrets):
        return REDACTED
    return value


def redact_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The config with secrets removed: values of keys named like api_key/token/password, and
    any string containing a secret value of the environment."""
    return _redact_tree(dict(config), secret_values())


def config_secret_problems(resolved: Mapping[str, Any], unresolved: Mapping[str, Any]) -> list[str]:
    """Config fields that hold a secret: a string containing a secret value (``resolved``), or an
    ``oc.env`` interpolation of a secret variable (``unresolved``). The messages name the field
    and the variable, never the value."""
    names = secret_env_names()
    secrets = {os.environ[n]: n for n in names}
    problems: list[str] = []

    def walk(res: Any, raw: Any, path: str) -> None:
        if isinstance(res, Mapping):
            for k, v in res.items():
                walk(v, raw.get(k) if isinstance(raw, Mapping) else None, f"{path}.{k}" if path else str(k))
            return
        if isinstance(res, list | tuple):
            for i, v in enumerate(res):
                walk(v, raw[i] if isinstance(raw, list | tuple) and i < len(raw) else None, f"{path}[{i}]")
            return
        interpolated = [n for n in names if isinstance(raw, str) and re.search(rf"oc\.env:\s*{n}\b", raw)]
        contained = [n for s, n in secrets.items() if isinstance(res, str) and s in res]
        for n in sorted(set(interpolated + contained)):
            problems.append(
                f"{path} holds the value of the secret {n}: secrets never go into a config (it is written to "
                f"config.yaml, checkpoints and W&B); W&B and the hub read {n} from the environment themselves, "
                f"so remove it from {path}"
            )

    walk(resolved, unresolved, "")
    return problems


class SecretFilter(logging.Filter):
    """Redacts secret values from a log record (message, arguments, traceback) in place."""

    def filter(self, record: logging.LogRecord) -> bool:
        secrets = secret_values()
        if not secrets:
            return True
        message = record.getMessage()
        if any(s in message for s in secrets):
            record.msg, record.args = redact(message, secrets), None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text and any(s in record.exc_text for s in secrets):
            record.exc_text = redact(record.exc_text, secrets)
        return True


def install_log_redaction() -> None:
    """Add a ``SecretFilter`` to every handler of the root logger (idempotent)."""
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, SecretFilter) for f in handler.filters):
            handler.addFilter(SecretFilter())
