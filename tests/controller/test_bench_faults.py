"""The fault suite's core, as CI runs it (``bench/faults.py``; the full suite is ``spectune bench faults``).

On the suite's own redis-server and PostgreSQL cluster (initdb in a temporary folder) with a ``spectune sidecar``
process between them: Redis is killed and restarted with nothing lost or stored twice, a fuzz batch is
dead-lettered with every entry accounted for, and everything the suite started is gone afterwards. The shared
servers are not used. A missing ``redis-server``, ``initdb`` or ``pg_ctl`` fails the test with what to install.
"""

from __future__ import annotations

import os
import shutil
import socket
from dataclasses import replace
from pathlib import Path

import pytest

from bench.faults import (
    FIELDS,
    PG_BINARIES,
    PRESETS,
    FaultSuiteError,
    Suite,
    evaluate,
    scenario_fuzz,
    scenario_redis_kill,
)

CORE = replace(PRESETS["quick"], redis_down_s=3, fuzz_entries=300, fuzz_pool=60, before_s=1, after_s=2)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_fault_suite_core(tmp_path: Path) -> None:
    missing = [b for b in ("redis-server", *PG_BINARIES) if shutil.which(b) is None]
    if missing:
        pytest.fail(f"{', '.join(missing)} not on PATH: the fault suite starts its own Redis and PostgreSQL; install "
                    "redis-server and PostgreSQL's server binaries (initdb, pg_ctl)", pytrace=False)
    suite = Suite(CORE, tmp_path, engine=False, profile="small")
    try:
        try:
            suite.start()
            suite.warm_up()
        except FaultSuiteError as e:
            pytest.fail(f"the fault suite could not start its services: {e}", pytrace=False)
        assert suite.redis.port != 6379 and suite.pg.port != 5432
        pids = [p for p in (suite.redis.proc.pid if suite.redis.proc else None, suite.pg.postmaster_pid(),
                            suite.sc.pid) if p is not None]
        assert len(pids) == 3 and all(_alive(p) for p in pids)
        ports = (suite.redis.port, suite.pg.port)

        rk = scenario_redis_kill(suite)
        assert rk["windows_sent"] > 0 and rk["feeder_failures"] > 0, rk  # it did feed through an outage
        assert (rk["windows_lost"], rk["windows_duplicated"]) == (0, 0), rk
        assert rk["undelivered_at_kill"] == 0 and not rk["sidecar_crashed"], rk
        assert rk["recovery_s"]["first_window_stored_s"] is not None, rk

        fz = scenario_fuzz(suite)
        assert fz["drained"] and not fz["sidecar_crashed"], fz
        assert fz["dead_lettered"] > 0 and fz["fuzz_unaccounted"] == 0, fz
        assert (fz["windows_lost"], fz["windows_duplicated"]) == (0, 0), fz

        for rec in (rk, fz):
            assert set(FIELDS) <= set(rec), set(FIELDS) - set(rec)
        targets = evaluate({"redis_kill": rk, "fuzz": fz}, None)
        assert targets["windows_lost"]["met"] and targets["crashes"]["met"] and targets["fuzz_unaccounted"]["met"]
    finally:
        suite.close()
    assert not any(_alive(p) for p in pids), "the suite left a process it started running"
    assert all(_port_free(p) for p in ports)
    assert not suite.pg.dir.exists(), "the PostgreSQL folder was left behind"
