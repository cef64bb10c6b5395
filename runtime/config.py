"""The one settings object.

Precedence, highest first: explicit arguments, NODESHARE_* environment variables, the TOML file
named by --config or NODESHARE_CONFIG, defaults. Unknown keys and bad values are errors that
name the key. deploy/nodeshare.example.toml documents every key.

Settings depend on nothing of the domain: the defaults are plain values (a test checks they are
the domain's own), and the policy objects are built where they are used, from these fields, by
the methods below, which import their types when called.
"""

from __future__ import annotations

import json
import logging
import os
import re
from contextvars import ContextVar
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, TomlConfigSettingsSource

if TYPE_CHECKING:  # the policy types, for the methods' signatures only
    from nodeshare.producers.batching import FlushPolicy
    from nodeshare.schemas.signing import Signer, Verifier
    from nodeshare.streams.core.accounting import PricingPolicy
    from nodeshare.streams.core.power.ppartition import PowerPolicy
    from nodeshare.streams.core.shutter_policy import ShutterPolicy


#: The configuration file given on the command line (--config); NODESHARE_CONFIG is the fallback.
CONFIG_FILE: ContextVar[Path | None] = ContextVar("nodeshare_config_file", default=None)

#: What in a setting's name marks its value as a secret, never printed or logged: any password,
#: passphrase, secret, key (private keys, key stores; ``*.key.location`` paths too, harmlessly),
#: token, credential, PEM text or JAAS line, at any depth. Matched by pattern, not by a list of
#: names, so a property a newer librdkafka adds is masked before anyone thinks of it.
SECRET_NAME = re.compile(r"pass(word|wd|phrase)|secret|key|token|credential|pem|jaas", re.IGNORECASE)
#: SASL settings that carry a credential without saying so in their name: OAUTHBEARER's config
#: string (``principal=... extension_*=...``) and extensions, and Kerberos' kinit command line.
SECRET_SASL = frozenset({"sasl.oauthbearer.config", "sasl.oauthbearer.extensions", "sasl.kerberos.kinit.cmd"})
MASK = "***"
#: Where the confluent-kafka clients' (librdkafka's) log lines go.
KAFKA_LOG = logging.getLogger("nodeshare.kafka")


def is_secret(name: str) -> bool:
    """Whether a setting called ``name`` (a librdkafka property, a TOML or JSON key) holds a secret."""
    return bool(SECRET_NAME.search(name)) or name.lower() in SECRET_SASL


def masked_value(value: Any, name: str = "") -> Any:
    """``value`` with every secret in it replaced by ``***``: dicts and lists at any depth, and a
    string that is itself a JSON object or list (a setting holding JSON, as NODESHARE_KAFKA does)."""
    if name and is_secret(name):
        return MASK if value not in (None, "", {}, []) else value
    if isinstance(value, dict):
        return {k: masked_value(v, str(k)) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [masked_value(v) for v in value]
    if isinstance(value, str) and value.lstrip()[:1] in ("{", "["):
        try:
            inner = json.loads(value)
        except ValueError:
            return value
        if isinstance(inner, dict | list):
            return json.dumps(masked_value(inner))
    return value


def _leaves(value: Any) -> list[str]:
    if isinstance(value, dict):
        return [s for v in value.values() for s in _leaves(v)]
    if isinstance(value, list | tuple):
        return [s for v in value for s in _leaves(v)]
    return [] if value in (None, "") else [str(value)]


def secret_values(value: Any, name: str = "") -> list[str]:
    """Every secret string in ``value`` (what ``masked_value`` hides), for the log formatter."""
    if name and is_secret(name):
        return _leaves(value)
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in secret_values(v, str(k))]
    if isinstance(value, list | tuple):
        return [s for v in value for s in secret_values(v)]
    if isinstance(value, str) and value.lstrip()[:1] in ("{", "["):
        try:
            return secret_values(json.loads(value))
        except ValueError:
            return []
    return []


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
    app_id: str = Field("nodeshare", description="faust application id (consumer group of the power and placement "
                                                 "agents); the charge fold and the sinks derive their groups from it")
    session_timeout_ms: Annotated[int, Field(ge=1000)] = 6000  # docs/broker.md: ~3 s to join at 6 s
    # How often the stream worker looks for messages faust skipped at a partition's end (streams.worker.cursor)
    skip_check_interval_s: Annotated[float, Field(gt=0.0)] = 5.0
    # How often the power and placement managers snapshot their state (streams.core.snapshot): after
    # this many log records, or this many seconds after a record not yet in a snapshot. Both far
    # below the logs' retention (7 days by default): a rebuild needs the log after the snapshot.
    snapshot_every_records: Annotated[int, Field(ge=1)] = 10_000
    snapshot_every_s: Annotated[float, Field(gt=0.0)] = 600.0
    # How often the charge fold snapshots each input partition's job accounts (streams.core.fold_snapshot):
    # after this many input messages of the partition, or this many seconds after one not yet in a
    # snapshot. A rebuild folds only the messages after the newest snapshot, so node.ipc and
    # jobs.lifecycle may delete what is older (docs/operations.md, retention).
    fold_snapshot_every_records: Annotated[int, Field(ge=1)] = 50_000
    fold_snapshot_every_s: Annotated[float, Field(gt=0.0)] = 600.0
    # How long a charged job's account (nothing waiting for a node) stays in the charge fold's memory
    # after its latest charge before it moves to accounting.settled, from where a late record of the
    # job reads it back (streams.worker.fold_settled); inf: every account stays in memory for ever
    fold_evict_after_s: Annotated[float, Field(ge=0.0)] = 300.0
    rate_per_core_hour: Annotated[float, Field(gt=0.0)] = 1.0  # POPPA's L
    delta: Annotated[float, Field(gt=0.0)] = 0.05  # streams.core.degradation.DEFAULT_DELTA
    rate_function: Literal["poppa_eq4", "solo_baseline", "sop"] = "poppa_eq4"  # streams.core.pricing.RATE_FUNCTIONS
    # streams.core.degradation.ESTIMATORS
    estimator: Literal["refill_corrected", "poppa_alg4", "unfiltered", "mixed_s"] = "mixed_s"
    # How sure a charge is (streams.core.confidence): the interval's confidence, whether the price
    # uses its upper end (true) or the point estimate, and the prior's upper end for too few blocks
    confidence: Annotated[float, Field(gt=0.0, le=0.99)] = 0.95  # streams.core.confidence.MAX_CONFIDENCE
    price_at_bound: bool = False
    prior_high: Annotated[float, Field(ge=0.0, le=1.0)] = 0.25
    # the interval's margin for the estimator's bias, margin_abs + margin_rel x D (docs/charges.md)
    margin_abs: Annotated[float, Field(ge=0.0, le=1.0)] = 0.01  # confidence.DEFAULT_MARGIN_ABS
    margin_rel: Annotated[float, Field(ge=0.0, le=1.0)] = 0.05  # confidence.DEFAULT_MARGIN_REL
    # the short-sample margin: widens the interval of an estimate from samples of S <= short_sample_us
    # that no longer S checked, and is added to its D priced where the job never took its long
    # samples (docs/charges.md, "The short-sample margin")
    short_margin: Annotated[float, Field(ge=0.0, le=1.0)] = 0.03  # confidence.DEFAULT_SHORT_MARGIN
    short_sample_us: Annotated[int, Field(ge=1, le=1_000_000)] = 3200  # confidence.DEFAULT_SHORT_SAMPLE_US
    # What the standard price multiplies (streams.core.pricing.billed_units): "cores" (POPPA's C), or
    # "tres": Slurm's billing count where the lifecycle event carries it (the Slurm source's), else the
    # partition's TRESBillingWeights below (slurm.conf's syntax, "CPU=1.0,Mem=0.25G,GRES/gpu=2.0")
    # applied to its TRES, else the cores. A site that switches sees its prices move: docs/charges.md.
    standard_units: Literal["cores", "tres"] = "cores"
    billing_weights: dict[str, str] = {}
    # POPPA's shutter parameters (Seed 002, Section 5): K samples per region of S us, every P ms.
    samples_per_region: Annotated[int, Field(ge=1, le=64)] = 1
    sample_us: Annotated[int, Field(ge=50, le=1_000_000)] = 3200
    period_ms: Annotated[int, Field(ge=1, le=3_600_000)] = 200
    # Issue 36: "adaptive" lets each job's shutters climb S, 4 S, 16 S (streams.core.shutter_policy)
    # where its cache refills slower than S; "fixed": S, K and P above on every cycle (POPPA's Alg. 3).
    # The node agents and the calibrated simulator (demo, simulate) read it; mixed_s charges its blocks.
    shutter_schedule: Literal["fixed", "adaptive"] = "adaptive"
    # How node agents batch shutter blocks per node.ipc message (producers.batching.FlushPolicy)
    batch_blocks: Annotated[int, Field(ge=1, le=4096)] = 64  # DEFAULT_MAX_BLOCKS
    batch_age_s: Annotated[float, Field(ge=0.0)] = 30.0  # DEFAULT_MAX_AGE_S
    power_budget_watts: Annotated[float, Field(gt=0.0)] | None = None  # the machine's bound (Seed 004)
    power_admit: Literal["fair", "throughput"] = "fair"  # streams.core.power.ppartition.PowerPolicy
    power_release: Literal["proportional", "pool"] = "proportional"
    power_min_share: Annotated[float, Field(gt=0.0, le=1.0)] = 0.5
    power_margin: Annotated[float, Field(ge=0.0, le=1.0)] = 0.01
    placement_policy: Literal["SNS", "CS", "CE", "learned"] = "SNS"  # streams.core.placement.sns.POLICIES
    placement_pairing: Literal["blossom", "greedy", "off"] = "blossom"  # Seed 003 pairs of waiting jobs
    # longer waits block younger jobs (streams.core.placement.sns.DEFAULT_AGE_LIMIT_S)
    placement_age_limit_s: Annotated[float, Field(gt=0.0)] = 3600.0
    # the Slurm adapter releases a job it holds with no placement decision after this long (0: never;
    # producers.slurm_scheduler, placement fails open)
    placement_release_after_s: Annotated[float, Field(ge=0.0)] = 600.0
    # Record signatures (nodeshare.schemas.signing, docs/deployment.md "Identities"): the site secret
    # on the hosts that verify (the worker's charge fold and the audit then refuse input records not
    # signed by an identity allowed to write them), an identity's key on the host that is it.
    site_secret_file: Path | None = None
    signing_key_file: Path | None = None
    metrics_port: Annotated[int, Field(ge=1, le=65535)] | None = None  # Prometheus endpoint; off when unset
    metrics_addr: str = "127.0.0.1"
    log_format: Literal["text", "json"] = "text"  # nodeshare.runtime.logs: "json" writes one JSON object per line

    @field_validator("billing_weights")
    @classmethod
    def _billing_weights(cls, v: dict[str, str]) -> dict[str, str]:
        from nodeshare.streams.core.pricing import parse_billing_weights

        for partition, text in v.items():
            try:
                parse_billing_weights(text)
            except ValueError as exc:
                raise ValueError(f"partition {partition}: {exc}") from None
        return v

    @field_validator("placement_release_after_s")
    @classmethod
    def _release_after(cls, v: float) -> float:
        if 0.0 < v < 1.0:
            raise ValueError("0 (never release) or at least 1 s: the placement manager needs time to answer")
        return v

    @classmethod
    def settings_customise_sources(
        cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        path = config_file()
        if path is None:
            return init_settings, env_settings
        if not path.is_file():
            raise FileNotFoundError(f"configuration file {path} does not exist")
        return init_settings, env_settings, TomlConfigSettingsSource(settings_cls, toml_file=path)

    def topic(self, name: str) -> str:
        """The one way to name a topic on the bus: the catalog's name behind this deployment's prefix."""
        return f"{self.topic_prefix}{name}"

    def input_topics(self) -> dict[str, str]:
        """Each input topic's name on the bus -> its catalog name (what a signature covers)."""
        from nodeshare.schemas.catalog import INPUT_TOPICS

        return {self.topic(t.name): t.name for t in INPUT_TOPICS}

    def policy(self) -> PricingPolicy:
        from nodeshare import __version__
        from nodeshare.streams.core.accounting import PricingPolicy

        return PricingPolicy(rate_per_core_hour=self.rate_per_core_hour, delta=self.delta,
                             rate_function=self.rate_function, estimator=self.estimator,
                             confidence=self.confidence, price_at_bound=self.price_at_bound,
                             prior_high=self.prior_high, margin_abs=self.margin_abs, margin_rel=self.margin_rel,
                             short_margin=self.short_margin, short_sample_us=self.short_sample_us,
                             standard_units=self.standard_units,
                             billing_weights=tuple(sorted(self.billing_weights.items())), code_version=__version__)

    def shutter_policy(self) -> ShutterPolicy | None:
        """The adaptive schedule ``shutter_schedule`` names (ladder S, 4 S, 16 S at K and P), or None."""
        if self.shutter_schedule == "fixed":
            return None
        from nodeshare.streams.core.shutter_policy import ShutterPolicy

        return ShutterPolicy.from_shortest(self.sample_us, self.samples_per_region, self.period_ms)

    def flush_policy(self) -> FlushPolicy:
        from nodeshare.producers.batching import FlushPolicy

        return FlushPolicy(max_blocks=self.batch_blocks, max_age_s=self.batch_age_s)

    def power_policy(self) -> PowerPolicy:
        from nodeshare.streams.core.power.ppartition import PowerPolicy

        return PowerPolicy(release=self.power_release, min_share=self.power_min_share, admit=self.power_admit,
                           margin=self.power_margin)

    def verifier(self) -> Verifier | None:
        """What checks input records' signatures (None: ``site_secret_file`` unset, nothing checked)."""
        from nodeshare.runtime.identity import verifier

        return verifier(self.site_secret_file)

    def signer(self, service: str) -> Signer | None:
        """What signs the input records this process sends (None: no key or secret configured);
        ``service`` is the identity a site-secret signer gives a service's records."""
        from nodeshare.runtime.identity import signer

        return signer(self.signing_key_file, self.site_secret_file, service)

    def client_config(self, **extra: Any) -> dict[str, Any]:
        """librdkafka configuration for a confluent-kafka client."""
        if not self.bootstrap:
            raise RuntimeError("no Kafka bootstrap server: set NODESHARE_BOOTSTRAP or start the bundled broker")
        # An idle connection closed by the broker is normal (e.g. at shutdown), not worth a log line.
        # librdkafka's own log lines go through Python logging (nodeshare.runtime.logs: the operator's format,
        # secrets masked) rather than straight to stderr.
        return {"bootstrap.servers": self.bootstrap, "log.connection.close": False, "logger": KAFKA_LOG,
                **self.kafka, **extra}

    def group_consumer_config(self, group_id: str, **extra: Any) -> dict[str, Any]:
        """A consumer of a group that commits its own offsets after a durable step (the sinks, the
        charge fold): from the earliest offset, the session timeout the broker joins fast with, and
        fetches held at most 100 ms (Tansu holds a fetch for its whole wait: docs/broker.md)."""
        return self.client_config(**{
            "group.id": group_id,
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "session.timeout.ms": self.session_timeout_ms,
            "heartbeat.interval.ms": min(1000, self.session_timeout_ms // 3),
            "fetch.max.bytes": 52_428_800,
            "fetch.wait.max.ms": 100,
            **extra,
        })

    def as_env(self) -> dict[str, str]:
        """NODESHARE_* variables that reproduce these settings in a child process."""
        env = {}
        for name, value in self.model_dump().items():
            if value is None:
                continue
            env[f"NODESHARE_{name.upper()}"] = json.dumps(value) if isinstance(value, dict) else str(value)
        return env

    def secret_values(self) -> list[str]:
        """The values that must never be printed or logged (nodeshare.runtime.logs masks them)."""
        return secret_values(self.model_dump())

    def masked(self) -> dict[str, Any]:
        """The settings as a dict, with secrets replaced by '***'."""
        return masked_value(self.model_dump())


def config_file() -> Path | None:
    """The configuration file in force: --config, else NODESHARE_CONFIG, else none."""
    chosen = CONFIG_FILE.get()
    if chosen is not None:
        return chosen
    env = os.environ.get("NODESHARE_CONFIG")
    return Path(env) if env else None
