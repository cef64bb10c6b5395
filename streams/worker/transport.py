"""faust's Kafka transport with a short fetch wait.

faust builds its aiokafka consumer with ``fetch_max_wait_ms=1500`` and no setting to change it.
A broker that holds a fetch for its whole wait although data has arrived meanwhile (the bundled
Tansu measured so) adds up to that wait to every event's trip through the worker: job end to
charge took 0.57 s at p50 with 1,500 ms and 0.10 s with 100 ms (300 events/s, `nodeshare bench
stream`'s latency run). On Apache Kafka a fetch returns as soon as data is there, and the shorter
wait only adds empty fetches of an idle consumer (ten a second).
"""

from __future__ import annotations

from typing import Any

import aiokafka
import faust
from faust.transport.drivers import aiokafka as driver

#: How long the broker may hold a fetch that has nothing to return yet.
FETCH_MAX_WAIT_MS = 100


class _ConsumerThread(driver.AIOKafkaConsumerThread):
    def _create_worker_consumer(self, transport: Any) -> aiokafka.AIOKafkaConsumer:
        consumer = super()._create_worker_consumer(transport)
        # read when the consumer starts (it builds its fetcher then): the constructor's value, set late
        consumer._fetch_max_wait_ms = FETCH_MAX_WAIT_MS
        return consumer


class _Consumer(driver.Consumer):
    def _new_consumer_thread(self) -> driver.AIOKafkaConsumerThread:
        return _ConsumerThread(self, loop=self.loop, beacon=self.beacon)


class Transport(driver.Transport):
    """aiokafka's transport whose worker consumer waits at most FETCH_MAX_WAIT_MS per fetch."""

    Consumer = _Consumer


def use_short_fetch_wait(app: faust.App) -> None:
    """Give ``app`` the transport above, for the brokers it is configured with."""
    app.transport = Transport(app.conf.broker_consumer, app)


class Worker(faust.Worker):
    """faust's worker without its terminal spinner. The spinner's handler sets the root logger to
    DEBUG, so every ``log.debug`` in faust and aiokafka builds a LogRecord that the handlers then
    drop: 3.7% of a busy stream worker's time (py-spy, `nodeshare bench stream`)."""

    def on_setup_root_logger(self, logger: Any, level: int) -> None:
        self.spinner = None
