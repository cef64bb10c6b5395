"""JSON Schema files of the topic values: what a non-Python producer or consumer codes against."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .catalog import TOPICS, TopicSpec, adapter


def schema_dir() -> Path:
    return Path(__file__).parent / "json"


def topic_schema(spec: TopicSpec) -> dict[str, Any]:
    schema = adapter(spec).json_schema(mode="serialization")
    schema.setdefault("title", spec.name)
    schema["description"] = f"Value of topic {spec.name}: {spec.description}. Key: {spec.key_field}."
    return schema


def rendered() -> dict[str, str]:
    """File name -> exact file content, for every topic."""
    return {f"{t.name}.schema.json": json.dumps(topic_schema(t), indent=2, sort_keys=True) + "\n" for t in TOPICS}


def export_schemas(directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in rendered().items():
        path = directory / name
        path.write_text(text)
        written.append(path)
    return written
