"""The bundled broker launcher and idempotent topic creation."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from nodeshare.deploy.broker import BundledBroker, wait_for_metadata
from nodeshare.deploy.processes import pid_alive
from nodeshare.deploy.topics import create_topics
from nodeshare.runtime.config import Settings
from nodeshare.schemas import TOPICS
from nodeshare.schemas.catalog import INTERNAL_TOPICS

pytestmark = pytest.mark.integration


def _gone_within(pid: int, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not pid_alive(pid):
            return True
        with contextlib.suppress(ChildProcessError):  # reap our own child: a zombie still answers kill(0)
            os.waitpid(pid, os.WNOHANG)
        time.sleep(0.05)
    return not pid_alive(pid)


def test_bundled_broker_answers_and_stops_cleanly(tmp_path):
    with BundledBroker(log_path=tmp_path / "t.log") as b:
        wait_for_metadata(b.bootstrap, 5)
        pid = b.pid
    assert pid is not None and _gone_within(pid, 5)


def test_bundled_broker_dies_with_a_killed_parent(tmp_path):
    script = textwrap.dedent(f"""
        from nodeshare.deploy.broker import BundledBroker
        import time, sys
        b = BundledBroker(log_path={str(tmp_path / 'c.log')!r}).start()
        print(b.pid, flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert pid_alive(child)
        parent.send_signal(signal.SIGKILL)  # no cleanup code can run in the parent
        parent.wait(10)
        assert _gone_within(child, 10), "tansu outlived its parent"
    finally:
        parent.kill()


def test_topics_create_is_idempotent(settings: Settings):
    first = create_topics(settings)
    wanted = {settings.topic(t.name) for t in TOPICS} | {settings.topic(n) for n in INTERNAL_TOPICS}
    assert set(first) == wanted and set(first.values()) == {"created"}
    second = create_topics(settings)
    assert set(second.values()) == {"exists"}


def test_nodeshare_broker_listens_on_the_host_it_is_given_and_gives_clients_that_address() -> None:
    """``nodeshare broker --host``: namespace nodes reach the broker on the host's bridge address,
    not on loopback (docs/deployment.md). 127.0.0.2 is a loopback address no default listens on."""
    from nodeshare.deploy.broker import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "nodeshare", "broker", "--host", "127.0.0.2", "--port", str(port)],
                            env={**os.environ, "NODESHARE_CONFIG": ""}, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert f"127.0.0.2:{port}" in first and f"NODESHARE_BOOTSTRAP=127.0.0.2:{port}" in first, first
        wait_for_metadata(f"127.0.0.2:{port}")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
