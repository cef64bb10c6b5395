"""A decision maker's state as of an offset of its log: what survives the log's retention.

The placement and power managers are deterministic folds of a single-partition log
(``placement.cluster``, ``power.machine``) that deletes old records. A restarted worker rebuilds a
manager from its latest snapshot (a compacted topic beside the log) and folds only the log after
it: the same state as folding the whole log, whatever retention has deleted before the snapshot.

A snapshot is ``dump(manager, offset)``: a header (format, the log offset the state is after, the
manager's configuration, a digest) and the pickled manager. ``load`` refuses a snapshot of another
format or a damaged one (``SnapshotError``), and ``usable`` one taken under another configuration
(a changed budget or policy: the log is folded from its start again, as without snapshots).
Pickle runs code on load, so the snapshot topics must be writable by the stream worker only (as its
log topics are: docs/deployment.md), and ``load`` unpickles with an allowlist besides: only the
pure core's and the schemas' own classes and functions (defined there: never a module or a name
they import), ``datetime`` and pydantic's time zone, numpy's array reconstruction and
scikit-learn's tree and forest classes (a trained pair model), and ``getattr`` on the core's own
classes and objects for names that are not dunders. A snapshot that names anything else (``os.system``, a
function's ``__globals__``) is refused as damaged, never run.
"""

from __future__ import annotations

import hashlib
import inspect
import io
import pickle
from typing import Any

FORMAT = 1
MAGIC = b"nodeshare-snapshot"


class SnapshotError(ValueError):
    """A snapshot this build cannot use."""


def config_of(manager: Any) -> str:
    """What a manager was configured with (its ``config()``): a snapshot under another is not used."""
    return repr(manager.config())


def dump(manager: Any, offset: int) -> bytes:
    """The manager's state after the log's records before ``offset``."""
    body = pickle.dumps(manager, protocol=pickle.HIGHEST_PROTOCOL)
    head = f"{FORMAT} {offset} {hashlib.sha256(body).hexdigest()} {config_of(manager)}".encode()
    return MAGIC + b" " + head + b"\n" + body


def header(raw: bytes) -> tuple[int, str, bytes]:
    """(offset, configuration, pickled state) of a snapshot, checked but not unpickled; raises
    SnapshotError."""
    head, sep, body = raw.partition(b"\n")
    parts = head.split(b" ", 4)
    if not sep or len(parts) != 5 or parts[0] != MAGIC:
        raise SnapshotError("not a nodeshare snapshot")
    if parts[1] != str(FORMAT).encode():
        raise SnapshotError(f"snapshot format {parts[1].decode(errors='replace')}; this build reads {FORMAT}")
    if hashlib.sha256(body).hexdigest().encode() != parts[3]:
        raise SnapshotError("snapshot damaged: its digest does not match")
    return int(parts[2]), parts[4].decode(), body


#: What a snapshot may name: modules of the pure core and the schemas (no I/O, no process), and these.
_CORE_MODULES = ("nodeshare.streams.core.", "nodeshare.schemas.")
_ALSO = {("datetime", "datetime"), ("datetime", "timedelta"), ("datetime", "timezone"),
         ("pydantic_core._pydantic_core", "TzInfo"),
         # a trained pair model's arrays (the placement manager's forest)
         ("numpy", "dtype"), ("numpy", "ndarray"), ("numpy._core.numeric", "_frombuffer"),
         ("numpy.core.numeric", "_frombuffer"), ("numpy._core.multiarray", "_reconstruct"),
         ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "scalar"),
         ("numpy.core.multiarray", "scalar")}
#: ... and the classes (never the functions) of scikit-learn's trees and forests
_MODEL_MODULES = ("sklearn.ensemble.", "sklearn.tree.")


def _in_core(obj: Any) -> bool:
    """A class or function defined in the core or the schemas, or an instance of such a class."""
    owner = obj if isinstance(obj, type) or inspect.isfunction(obj) else type(obj)
    return str(getattr(owner, "__module__", "")).startswith(_CORE_MODULES)


def _core_getattr(obj: Any, name: str) -> Any:
    """``getattr`` as a snapshot may use it: pickle reaches nested names and bound methods so
    (``Class.method``, ``manager._veto``), on the core's own classes and objects only, never a
    dunder (``__globals__``, ``__class__``) and never out of the core (a module, numpy)."""
    if name.startswith("__") or not _in_core(obj):
        raise pickle.UnpicklingError(f"a snapshot may not reach {name!r} of {type(obj).__name__}")
    found = getattr(obj, name)
    if inspect.ismodule(found):
        raise pickle.UnpicklingError(f"a snapshot may not reach the module {name!r}")
    return found


class _CoreUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("builtins", "getattr"):
            return _core_getattr
        if (module, name) in _ALSO:
            return super().find_class(module, name)
        if module.startswith(_CORE_MODULES) and not name.startswith("__"):
            found = super().find_class(module, name)
            # a class or function *defined* there: not a module it imports (pickle, numpy) nor what it imported
            if (isinstance(found, type) or inspect.isfunction(found)) and found.__module__ == module:
                return found
        if module.startswith(_MODEL_MODULES) and not name.startswith("_"):
            found = super().find_class(module, name)
            if isinstance(found, type) and found.__module__ == module:
                return found
        raise pickle.UnpicklingError(f"a snapshot may not name {module}.{name}")


def load(raw: bytes) -> tuple[int, str, Any]:
    """(offset, configuration, manager) of a snapshot; raises SnapshotError."""
    offset, config, body = header(raw)
    try:
        return offset, config, _CoreUnpickler(io.BytesIO(body)).load()  # the worker's own topic
    except Exception as exc:  # a class renamed since, or a name outside the allowlist: fold the log instead
        raise SnapshotError(f"snapshot unreadable: {exc}") from exc


def usable(raw: bytes | None, fresh: Any) -> tuple[int, Any]:
    """Where to fold the log from, and the manager to fold into: the snapshot's when it is one of
    this format and configuration; else 0 and ``fresh``. (A snapshot is taken only between records,
    after a record's decisions were sent: one past where consumption would resume holds those
    records already, and consumption resumes after it.)"""
    if raw is None:
        return 0, fresh
    offset, config, manager = load(raw)
    if config != config_of(fresh) or type(manager) is not type(fresh):
        return 0, fresh
    return offset, manager
