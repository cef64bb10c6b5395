"""Logs operators can grep: one line per record, as text or as JSON lines, with secrets masked.

Every nodeshare process (stream worker, sinks, node agent, Slurm source) configures its logging
here, from ``Settings.log_format``. A record carries the fields of ``FIELDS`` when the call site
knows them (``log.info(..., extra=fields(job_id=..., topic=...))``) and the process's own fields
(the agent's node, the process's component) on every line. Whatever the format, the values of the
secret settings (``config.is_secret``: by name pattern, at any depth) are replaced by ``***`` in the final line,
exceptions and third-party messages included, so no secret reaches a log file.
"""

from __future__ import annotations

import json
import logging
import logging.config
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nodeshare.runtime.config import Settings

#: Structured fields a record may carry, in the order they are printed.
FIELDS = ("component", "node", "job_id", "topic", "partition", "kind")
MASK = "***"
FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


def fields(**values: Any) -> dict[str, Any]:
    """``extra=`` for a log call: the structured fields that are known (None ones are left out)."""
    unknown = set(values) - set(FIELDS)
    if unknown:
        raise ValueError(f"unknown log field(s) {sorted(unknown)}; known: {', '.join(FIELDS)}")
    return {k: v for k, v in values.items() if v is not None}


class _Masking(logging.Formatter):
    def __init__(self, fmt: str | None = None, secrets: Iterable[str] = (), static: Mapping[str, Any] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(fmt, **kwargs)
        # longest first, so a secret containing another is masked whole
        self.secrets = sorted({s for s in secrets if s}, key=len, reverse=True)
        self.static = dict(static or {})

    def _fields(self, record: logging.LogRecord) -> dict[str, Any]:
        found = dict(self.static)
        for name in FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                found[name] = value
        return {name: found[name] for name in FIELDS if name in found}

    def mask(self, line: str) -> str:
        for secret in self.secrets:
            line = line.replace(secret, MASK)
        return line


class TextFormatter(_Masking):
    """``time logger LEVEL message key=value ...``, then the traceback if there is one: the fields
    stay on the record's first line, where a grep finds them."""

    def __init__(self, secrets: Iterable[str] = (), static: Mapping[str, Any] | None = None) -> None:
        super().__init__(TEXT_FORMAT, secrets, static)

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        extra = " ".join(f"{k}={v}" for k, v in self._fields(record).items())
        return f"{line} {extra}" if extra else line

    def format(self, record: logging.LogRecord) -> str:
        return self.mask(super().format(record))


class JsonFormatter(_Masking):
    """One JSON object per line: ``ts`` (UTC, ISO 8601), ``level``, ``logger``, ``msg``, the known
    fields, and ``exc`` with the traceback when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        line: dict[str, Any] = {"ts": ts, "level": record.levelname, "logger": record.name,
                                "msg": record.getMessage(), **self._fields(record)}
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exc"] = record.exc_text
        return self.mask(json.dumps(line, default=str))


def dict_config(log_format: str, level: str | int, secrets: Iterable[str] = (),
                static: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A ``logging.config.dictConfig`` that sends every record to stderr in ``log_format``; it is
    also handed to faust, whose worker would otherwise install its own coloured handler."""
    if log_format not in FORMATS:
        raise ValueError(f"log format {log_format!r}: expected one of {', '.join(FORMATS)}")
    formatter = JsonFormatter if log_format == "json" else TextFormatter
    level_name = logging.getLevelName(level) if isinstance(level, int) else level.upper()
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"nodeshare": {"()": formatter, "secrets": list(secrets), "static": dict(static or {})}},
        "handlers": {"stderr": {"class": "logging.StreamHandler", "stream": "ext://sys.stderr",
                                "formatter": "nodeshare"}},
        "root": {"level": level_name, "handlers": ["stderr"]},
    }


def configure(settings: Settings, component: str, level: str | int = "info", **static: Any) -> None:
    """Configure this process's logging from its settings: format, masked secrets, static fields."""
    logging.config.dictConfig(dict_config(settings.log_format, level, settings.secret_values(),
                                          fields(component=component, **static)))
