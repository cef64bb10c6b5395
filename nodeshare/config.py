"""The one settings object: defaults, overridden by NODESHARE_* environment variables."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from nodeshare.streams.accounting import PricingPolicy
from nodeshare.streams.degradation import DEFAULT_DELTA
from nodeshare.streams.pricing import POPPA_EQ4

#: Kafka client settings whose values must never be printed or logged.
SECRET_KAFKA_KEYS = frozenset({"sasl.password", "ssl.key.password", "ssl.keystore.password"})


class Settings(BaseSettings):
    """Effective configuration. Every field can be set as NODESHARE_<FIELD> (e.g. NODESHARE_BOOTSTRAP)."""

    model_config = SettingsConfigDict(env_prefix="NODESHARE_", extra="forbid", frozen=True)

    bootstrap: str | None = Field(
        None, description="Kafka bootstrap servers; when set, it wins over the bundled broker"
    )
    kafka: dict[str, str] = Field(
        default_factory=dict,
        description="extra librdkafka client settings passed to every client (security.protocol, sasl.*, "
        "ssl.*), as JSON in NODESHARE_KAFKA",
    )
    topic_prefix: str = Field("", description="prepended to every topic name")
    partitions: Annotated[int, Field(ge=1, le=1024)] = 4
    app_id: str = Field("nodeshare", description="faust application id (consumer group of the stream worker)")
    session_timeout_ms: Annotated[int, Field(ge=1000)] = 6000  # BROKER.md: ~3 s to join at 6 s
    rate_per_core_hour: Annotated[float, Field(gt=0.0)] = 1.0  # POPPA's L
    delta: Annotated[float, Field(gt=0.0)] = DEFAULT_DELTA
    rate_function: Literal["poppa_eq4", "solo_baseline", "sop"] = POPPA_EQ4  # streams.pricing.RATE_FUNCTIONS

    def topic(self, name: str) -> str:
        return f"{self.topic_prefix}{name}"

    def policy(self) -> PricingPolicy:
        return PricingPolicy(rate_per_core_hour=self.rate_per_core_hour, delta=self.delta,
                             rate_function=self.rate_function)

    def client_config(self, **extra: Any) -> dict[str, Any]:
        """librdkafka configuration for a confluent-kafka client."""
        if not self.bootstrap:
            raise RuntimeError("no Kafka bootstrap server: set NODESHARE_BOOTSTRAP or start the bundled broker")
        # An idle connection closed by the broker is normal (e.g. at shutdown), not worth a log line.
        return {"bootstrap.servers": self.bootstrap, "log.connection.close": False, **self.kafka, **extra}

    def as_env(self) -> dict[str, str]:
        """NODESHARE_* variables that reproduce these settings in a child process."""
        env = {}
        for name, value in self.model_dump().items():
            if value is None:
                continue
            env[f"NODESHARE_{name.upper()}"] = json.dumps(value) if isinstance(value, dict) else str(value)
        return env

    def masked(self) -> dict[str, Any]:
        """The settings as a dict, with secrets replaced by '***'."""
        data = self.model_dump()
        data["kafka"] = {k: ("***" if k in SECRET_KAFKA_KEYS else v) for k, v in self.kafka.items()}
        return data
