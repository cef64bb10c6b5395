"""Logs: text or JSON lines, structured fields, and no secret in any line."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from nodeshare.runtime import logs
from nodeshare.runtime.config import Settings

SECRET = "pw-Zq81-never-print"


@pytest.fixture
def root_logging():
    """Whatever a test configures, the root logger is put back afterwards."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield root
    root.handlers[:] = handlers
    root.setLevel(level)


def _settings(log_format: str) -> Settings:
    return Settings(bootstrap="127.0.0.1:9092", log_format=log_format,
                    kafka={"security.protocol": "SASL_SSL", "sasl.username": "nodeshare", "sasl.password": SECRET})


def _emit(capsys, log_format: str, component: str = "agent", **static) -> list[str]:
    logs.configure(_settings(log_format), component, "debug", **static)
    log = logging.getLogger("nodeshare.test")
    log.info("job %s left: %d blocks", "j-7", 12, extra=logs.fields(job_id="j-7", topic="node.ipc"))
    log.warning("password was %s", SECRET)  # a careless call site
    try:
        raise RuntimeError(f"connect failed with sasl.password={SECRET}")
    except RuntimeError:
        log.exception("broker refused", extra=logs.fields(partition=3))
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def test_json_lines_carry_the_fields_and_the_process_identity(capsys, root_logging):
    lines = _emit(capsys, "json", node="n17")
    records = [json.loads(line) for line in lines if line.startswith("{")]
    assert len(records) == 3
    first = records[0]
    assert first["msg"] == "job j-7 left: 12 blocks" and first["level"] == "INFO"
    assert first["logger"] == "nodeshare.test" and first["ts"].endswith("Z")
    assert (first["component"], first["node"], first["job_id"], first["topic"]) == ("agent", "n17", "j-7", "node.ipc")
    assert "job_id" not in records[1]  # only the fields a call knows
    assert records[2]["partition"] == 3 and "RuntimeError" in records[2]["exc"]


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_no_secret_reaches_a_line_not_even_from_a_traceback(capsys, root_logging, log_format):
    lines = _emit(capsys, log_format)
    assert len([line for line in lines if "nodeshare.test" in line]) == 3
    assert not [line for line in lines if SECRET in line]
    assert sum(logs.MASK in line for line in lines) >= 2  # the message and the exception were masked, not dropped


def test_text_lines_end_with_key_value_fields(capsys, root_logging):
    lines = _emit(capsys, "text", component="ledger-sink")
    assert lines[0].endswith("nodeshare.test INFO job j-7 left: 12 blocks component=ledger-sink job_id=j-7 "
                             "topic=node.ipc")
    # a record with a traceback keeps its fields on its first line, where a grep finds them
    failed = next(i for i, line in enumerate(lines) if "broker refused" in line)
    assert lines[failed].endswith("broker refused component=ledger-sink partition=3")
    assert lines[failed + 1].startswith("Traceback")


def test_a_longer_secret_containing_a_shorter_one_is_masked_whole():
    formatter = logs.TextFormatter(secrets=["abc", "abcdef"])
    assert formatter.mask("x abcdef y abc") == "x *** y ***"


def test_bad_fields_and_formats_are_errors_naming_them():
    with pytest.raises(ValueError, match="jobid"):
        logs.fields(jobid="j1")
    with pytest.raises(ValueError, match="xml"):
        logs.dict_config("xml", "info")
    with pytest.raises(ValueError, match="log_format"):
        Settings(log_format="xml")


def test_the_faust_worker_gets_the_same_configuration():
    config = logs.dict_config("json", "warning", [SECRET], logs.fields(component="worker"))
    formatter = config["formatters"]["nodeshare"]
    assert formatter["()"] is logs.JsonFormatter and formatter["secrets"] == [SECRET]
    assert config["root"] == {"level": "WARNING", "handlers": ["stderr"]}


def test_a_pipeline_timeout_says_the_worker_log_s_lastcomplaints(tmp_path: Path) -> None:
    """A CI report carries the message, not the log it names: the last warnings and errors come with it."""
    from nodeshare.demo import complaints

    log = tmp_path / "worker.log"
    said = ["INFO fine"] * 5 + ["WARNING first", "INFO between", "ERROR second", "WARNING third", "ERROR " + "x" * 400]
    log.write_text("\n".join(f"t nodeshare.x {line}" for line in said))
    said = complaints(log).splitlines()
    assert said[0] == "" and [line.split()[2] for line in said[1:]] == ["ERROR", "WARNING", "ERROR"]
    assert said[2].endswith("third") and len(said[3]) == 302  # indent, then 300 characters at most
    assert complaints(tmp_path / "missing.log") == ""
