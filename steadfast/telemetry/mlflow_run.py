"""Which MLflow run a run folder logs to (logger.sinks has mlflow), without importing mlflow.

<run folder>/mlflow_run.json holds a key of our own, the MLflow run's id and the tracking URI it
lives on, with anything that could be a credential cut off (user, password, query, fragment). The
key is recorded before the MLflow run is created, and the run carries it as a tag: an attempt
stopped between the two finds its run by the tag, so a run folder never gets a second MLflow run.
The file is read back bounded and validated; an unusable one is "no run yet" (with a warning).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple

from ..config import MlflowConf
from ..contract.files import MLFLOW_RUN_FILE, atomic_write, read_json_object

RUN_KEY_TAG = "steadfast.run_key"  # the MLflow run's tag that holds the key
MAX_RUN_FILE_BYTES = 4096
KEY = re.compile(r"[0-9a-f]{32}")
RUN_ID = re.compile(r"[a-zA-Z0-9][\w\-]{0,255}")  # MLflow's own rule for a run id
MAX_URI = 2048
_SECRET_QUERY = re.compile(r"(^|[?&;])[^=&;]*(pass|token|secret|key|auth)[^=&;]*=", re.IGNORECASE)


@dataclass(frozen=True)
class SavedRun:
    key: str
    run_id: Optional[str]  # None: recorded before the MLflow run was created (find it by its tag)
    tracking_uri: str  # redacted


def tracking_uri(conf: MlflowConf) -> Optional[str]:
    """logger.mlflow.tracking_uri, else MLFLOW_TRACKING_URI (None: MLflow's own default)."""
    return conf.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or None


def redacted(uri: str) -> str:
    """The URI without user, password, query and fragment: what may be recorded or shown."""
    head = uri.partition("#")[0].partition("?")[0]
    scheme, sep, rest = head.partition("://")
    if not sep:
        return head
    netloc, slash, path = rest.partition("/")
    return f"{scheme}://{netloc.rpartition('@')[2]}{slash}{path}"


def scrub(text: str, uri: str) -> str:
    """`text` (an error's message) with the URI's user, password and query replaced."""
    text = text.replace(uri, redacted(uri)) if uri else text
    userinfo = uri.partition("://")[2].partition("/")[0].rpartition("@")[0]
    query = uri.partition("#")[0].partition("?")[2]
    for secret in (userinfo, query):
        if secret:
            text = text.replace(secret, "***")
    return text


def credentials_in(uri: str) -> bool:
    """Whether the URI carries a user, a password or a secret-looking query parameter."""
    head = uri.partition("#")[0]
    query = head.partition("?")[2]
    scheme, sep, rest = head.partition("?")[0].partition("://")
    return bool(sep and "@" in rest.partition("/")[0]) or bool(_SECRET_QUERY.search(query))


def read(run_dir: Path) -> Tuple[Optional[SavedRun], Optional[str]]:
    """The run folder's MLflow run, and what made the file unusable (both None: there is none yet)."""
    path = run_dir / MLFLOW_RUN_FILE
    if not os.path.lexists(path):
        return None, None
    raw = read_json_object(path, MAX_RUN_FILE_BYTES)
    if raw is None:
        return None, f"{MLFLOW_RUN_FILE}: not a regular file holding a JSON object of at most {MAX_RUN_FILE_BYTES} bytes"
    key, run_id, uri = raw.get("key"), raw.get("run_id"), raw.get("tracking_uri")
    if not isinstance(key, str) or not KEY.fullmatch(key):
        return None, f"{MLFLOW_RUN_FILE}: key {key!r:.80} is not 32 hex digits"
    if run_id is not None and not (isinstance(run_id, str) and RUN_ID.fullmatch(run_id)):
        return None, f"{MLFLOW_RUN_FILE}: run_id {run_id!r:.80} is not an MLflow run id"
    if not isinstance(uri, str) or len(uri) > MAX_URI:
        return None, f"{MLFLOW_RUN_FILE}: tracking_uri {uri!r:.80} is not a URI"
    return SavedRun(key, run_id, uri), None


def write(run_dir: Path, saved: SavedRun) -> None:
    atomic_write(
        run_dir / MLFLOW_RUN_FILE,
        json.dumps({"key": saved.key, "run_id": saved.run_id, "tracking_uri": redacted(saved.tracking_uri)}, indent=1) + "\n",
    )
