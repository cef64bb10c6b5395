"""nodeshare's contract: record models, the topic catalog and the JSON serializer."""

from .catalog import (
    BY_NAME,
    INPUT_TOPICS,
    TOPIC_OF_RECORD,
    TOPICS,
    Role,
    TopicSpec,
    key_of,
    spec_for_topic,
)
from .events import (
    SCHEMA_VERSION,
    TERMINAL_STATES,
    Charge,
    CounterSource,
    DeadLetter,
    DegradationEstimate,
    EstimateStatus,
    IpcSample,
    JobEvent,
    JobLeftNode,
    JobState,
    LlcSample,
    NodeBlocks,
    NodeDown,
    NodeInventory,
    NodePowerState,
    OffsetRange,
    PlacementDecision,
    PowerDecision,
    PowerReading,
    ProgramProfile,
    Record,
    RowProblem,
    SampleMoments,
    ShutterBatch,
    ShutterBlock,
    ShutterWindow,
    clock_problem,
)
from .serde import DecodeError, decode, decode_model, encode

__all__ = [
    "BY_NAME", "INPUT_TOPICS", "SCHEMA_VERSION", "TERMINAL_STATES", "TOPICS", "TOPIC_OF_RECORD",
    "Charge", "CounterSource", "DeadLetter", "DecodeError", "DegradationEstimate", "EstimateStatus",
    "IpcSample", "JobEvent", "JobLeftNode", "JobState", "LlcSample", "NodeBlocks", "NodeDown", "NodeInventory",
    "NodePowerState", "OffsetRange",
    "PlacementDecision", "PowerDecision", "PowerReading", "ProgramProfile", "Record", "Role",
    "RowProblem", "SampleMoments", "ShutterBatch", "ShutterBlock", "ShutterWindow",
    "TopicSpec", "clock_problem", "decode", "decode_model", "encode",
    "key_of", "spec_for_topic",
]
