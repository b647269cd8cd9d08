"""The source's own time of a line record, so that a window carries when the engine observed it, not when it was
ingested (``spectune tune`` splits stored windows by time).

- ``vllm-log``: the line's prefix. vLLM formats its log lines as ``LEVEL MM-DD HH:MM:SS [file:line] message``
  (``vllm/logger.py``: ``_DATE_FORMAT = "%m-%d %H:%M:%S"``), local time without a year. The year is the
  ingesting machine's current one, or the one before when that would put the line more than a day in the future
  (a December log ingested in January); the time zone is the ingesting machine's (vLLM logs local time).
- ``vllm-request``: the OpenAI response's ``created`` (unix seconds; ``vllm/entrypoints/openai/
  chat_completion/protocol.py`` and ``completion/protocol.py``: ``int(time.time())`` when the response was made).
- ``trtllm``: an iteration's ``timestamp``, as unix seconds or the ``MM-DD-YYYY HH:MM:SS`` text of the
  recorded iteration stats.
- ``sglang``: a response's ``created`` when the line is a whole OpenAI-style response; ``meta_info`` alone holds
  no time.

A record without a time of its own gets None; the ingest stamps it with the ingest time and says so.
"""

from __future__ import annotations

import json
import re
import time
from datetime import datetime
from typing import Any

SECONDS_PER_DAY = 86_400.0
VLLM_LOG_TIME = re.compile(r"\b(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) (\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)\b")
TRTLLM_TIME_FORMAT = "%m-%d-%Y %H:%M:%S"


def record_times(source: str, line: str, now: float | None = None) -> list[float | None]:
    """The time of each record of one line (a TensorRT-LLM line may hold a list of iterations).

    Args:
        source: the ingest source.
        line: the line's text.
        now: the ingest time (for the year of a vLLM log line); default: the clock.

    Returns:
        One unix time (or None) per record; a single-record line gives one item.
    """
    if source == "vllm-log":
        return [vllm_log_time(line, time.time() if now is None else now)]
    try:
        obj = json.loads(line)
    except ValueError:
        return [None]
    if source == "trtllm":
        items = obj if isinstance(obj, list) else [obj]
        return [_trtllm_time(it) for it in items]
    if source in ("vllm-request", "sglang") and isinstance(obj, dict):
        return [_unix(obj.get("created"))]
    return [None]


def vllm_log_time(line: str, now: float) -> float | None:
    """The local time of a vLLM log line's prefix (see the module docstring for the year)."""
    m = VLLM_LOG_TIME.search(line)
    if m is None:
        return None
    month, day, hh, mm, ss = map(int, m.groups())
    year = datetime.fromtimestamp(now).year
    for y in (year, year - 1):
        try:
            t = datetime(y, month, day, hh, mm, ss).timestamp()
        except ValueError:  # 02-29 of a year without it
            continue
        if t <= now + SECONDS_PER_DAY:
            return t
    return None


def _trtllm_time(it: Any) -> float | None:
    if isinstance(it, str):
        try:
            it = json.loads(it)
        except ValueError:
            return None
    if not isinstance(it, dict):
        return None
    ts = it.get("timestamp")
    if isinstance(ts, str):
        try:
            return datetime.strptime(ts.strip(), TRTLLM_TIME_FORMAT).timestamp()
        except ValueError:
            return None
    return _unix(ts)


def _unix(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v < float("inf"):
        return None
    return float(v)
