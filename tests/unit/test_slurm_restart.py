"""The Slurm source's started map survives a restart: an epilog after it still ends the job."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nodeshare.producers.slurm import STARTED_FILE, SlurmSource
from nodeshare.schemas import JobState

ENV = {"SLURM_JOB_ID": "77", "SLURM_JOB_CPUS_PER_NODE": "4", "SLURM_JOB_NODELIST": "n1", "SLURM_JOB_USER": "u",
       "SLURM_JOB_ACCOUNT": "a", "SLURM_JOB_NAME": "p", "SLURM_JOB_EXIT_CODE": "0:0"}


class NoSlurm:
    def hostnames(self, expr: str) -> tuple[str, ...]:
        return tuple(expr.split(",")) if expr else ()

    def job_tres(self, job_id: str) -> dict[str, float]:
        return {}

    def queue(self) -> list[dict[str, str]]:
        return []


def hook(events: Path, name: str, at_ns: int, job: str = "77") -> Path:
    path = events / f"{at_ns}-{name}-1"
    path.write_bytes(b"\0".join(f"{k}={v}".encode() for k, v in {**ENV, "SLURM_JOB_ID": job}.items()))
    return path


def source(events: Path) -> SlurmSource:
    return SlurmSource(events, NoSlurm(), "c", terminal_from_epilog=True)  # type: ignore[arg-type]


def published(src: SlurmSource) -> list:
    events, files = src.step()
    src.done(files)
    return events


def test_a_job_started_before_a_restart_ends_after_it(tmp_path: Path) -> None:
    hook(tmp_path, "prolog_ctld", 1_790_000_000_000_000_000)
    (started,) = published(source(tmp_path))
    assert started.state is JobState.STARTED
    hook(tmp_path, "epilog_ctld", 1_790_000_060_000_000_000)
    (ended,) = published(source(tmp_path))  # a new process: the deploy, a crash, a reboot
    assert ended.state is JobState.ENDED and ended.job_id == "77"
    assert ended.start_time == started.start_time  # the prolog's time, as the started event said
    assert not (tmp_path / "bad").exists()
    assert json.loads((tmp_path / STARTED_FILE).read_text()) == {}  # an ended job leaves the map


def test_the_start_is_durable_before_the_prolog_file_goes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    prolog = hook(tmp_path, "prolog_ctld", 1_790_000_000_000_000_000)
    src = source(tmp_path)
    events, files = src.step()

    def killed(self: Path, missing_ok: bool = False) -> None:
        assert "77" in json.loads((tmp_path / STARTED_FILE).read_text())  # saved before any file is deleted
        raise KeyboardInterrupt("SIGKILL while deleting the acknowledged files")

    monkeypatch.setattr(Path, "unlink", killed)
    with pytest.raises(KeyboardInterrupt):
        src.done(files)
    monkeypatch.undo()
    assert prolog.exists()  # re-read after the restart: the same started event, de-duplicated downstream
    hook(tmp_path, "epilog_ctld", 1_790_000_060_000_000_000)
    again = published(source(tmp_path))
    assert [e.state for e in again] == [JobState.STARTED, JobState.ENDED]
    assert again[0].event_id == events[0].event_id and again[1].start_time == events[0].start_time


def test_only_unpublished_or_running_jobs_are_kept(tmp_path: Path) -> None:
    hook(tmp_path, "prolog_ctld", 1_790_000_000_000_000_000, job="1")
    hook(tmp_path, "prolog_ctld", 1_790_000_000_000_000_001, job="2")
    src = source(tmp_path)
    published(src)
    hook(tmp_path, "epilog_ctld", 1_790_000_060_000_000_000, job="1")
    events, _ = src.step()  # not acknowledged (broker down): the file and the start stay
    assert [e.state for e in events] == [JobState.ENDED]
    assert sorted(json.loads((tmp_path / STARTED_FILE).read_text())) == ["1", "2"]
    restarted = source(tmp_path)
    assert [e.job_id for e in published(restarted)] == ["1"]
    assert sorted(json.loads((tmp_path / STARTED_FILE).read_text())) == ["2"]


def test_an_unreadable_state_file_is_moved_aside(tmp_path: Path) -> None:
    (tmp_path / STARTED_FILE).write_text("{half")
    src = source(tmp_path)
    assert src.started == {} and (tmp_path / f"{STARTED_FILE}.unreadable").read_text() == "{half"
