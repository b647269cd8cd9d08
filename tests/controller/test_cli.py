"""The ``spectune`` command line: expected failures are one ``error:`` line and exit status 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from controller.cli import main

REPO = Path(__file__).resolve().parents[2]


def test_no_command_and_unknown_command_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in ([], ["frobnicate"], ["sidecar", "--k-max", "many"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2


def test_unknown_bench_lists_the_choices(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "nope"]) == 2
    err = capsys.readouterr().err
    assert "error: unknown benchmark 'nope'" in err and "controller" in err and "Traceback" not in err


def test_unreachable_services_say_what_to_do(capsys: pytest.CaptureFixture[str], sqlite_url: str) -> None:
    assert main(["sidecar", "--redis-url", "redis://127.0.0.1:1/0", "--db-url", sqlite_url]) == 2
    assert "start redis-server or pass --redis-url" in capsys.readouterr().err
    assert main(["policy", "show", "--sidecar-url", "http://127.0.0.1:1"]) == 2
    assert "start one with `spectune sidecar`" in capsys.readouterr().err
    assert main(["policy", "pin", "*|*|*|*|*", "2", "--sidecar-url", "http://127.0.0.1:1"]) == 2


def test_schema_out_of_date_names_the_upgrade_command(capsys: pytest.CaptureFixture[str], sqlite_url: str,
                                                      redis_url: str) -> None:
    assert main(["sidecar", "--db-url", sqlite_url, "--redis-url", redis_url]) == 2
    assert "spectune db upgrade" in capsys.readouterr().err
    assert main(["db", "upgrade", "--db-url", sqlite_url]) == 0


def test_pin_unpin_show_and_report_against_the_database(capsys: pytest.CaptureFixture[str], sqlite_url: str) -> None:
    assert main(["db", "upgrade", "--db-url", sqlite_url]) == 0
    assert main(["policy", "pin", "target-v1|draft-v1|code|*|*", "0", "--reason", "x", "--db-url", sqlite_url]) == 0
    assert main(["policy", "pin", "bad-key", "0", "--db-url", sqlite_url]) == 2
    assert main(["policy", "unpin", "target-v1|draft-v1|code|*|*", "--db-url", sqlite_url]) == 0
    assert main(["policy", "unpin", "target-v1|draft-v1|code|*|*", "--db-url", sqlite_url]) == 2
    assert main(["policy", "show", "--db-url", sqlite_url]) == 2  # no table yet
    assert "no policy table yet" in capsys.readouterr().err
    assert main(["report", "--db-url", sqlite_url]) == 0


def test_missing_checkpoints_is_an_error_not_a_traceback(capsys: pytest.CaptureFixture[str], redis_url: str,
                                                         tmp_path: Path) -> None:
    rc = main(["engine", "--redis-url", redis_url, "--checkpoints", str(tmp_path), "--duration", "1"])
    assert rc == 2 and "spectune train" in capsys.readouterr().err


def test_check_migrations() -> None:
    # A subprocess: alembic binds sys.stdout when it is first imported, which pytest's capture later closes.
    code = "from controller.cli import main; raise SystemExit(main(['db', 'check-migrations']))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "agree" in out.stdout, out.stdout + out.stderr


def test_sidecar_process_never_imports_torch(redis_url: str, redis_prefix: str, sqlite_url: str) -> None:
    code = (
        "import sys; from controller.cli import main; "
        f"rc = main(['sidecar', '--redis-url', {redis_url!r}, '--prefix', {redis_prefix!r}, '--db-url', "
        f"{sqlite_url!r}, '--auto-upgrade', '--http-port', '0', '--duration', '0.5']); "
        "print('TORCH', 'torch' in sys.modules, rc)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert "TORCH False 0" in out.stdout, out.stdout + out.stderr


def test_db_current_and_check_name_the_revision_and_the_fix(capsys: pytest.CaptureFixture[str],
                                                           sqlite_url: str) -> None:
    assert main(["db", "current", "--db-url", sqlite_url]) == 0
    assert "(empty)" in capsys.readouterr().out
    assert main(["db", "check", "--db-url", sqlite_url]) == 2
    assert "spectune db upgrade" in capsys.readouterr().err
    assert main(["db", "upgrade", "--db-url", sqlite_url]) == 0
    assert main(["db", "check", "--db-url", sqlite_url]) == 0
    assert main(["db", "current", "--db-url", sqlite_url]) == 0
    out = capsys.readouterr().out
    assert out.count("0005_scrape_baselines") >= 2


def test_one_k_per_batch_is_refused_for_a_policy_without_it(capsys: pytest.CaptureFixture[str],
                                                              sqlite_url: str) -> None:
    assert main(["sidecar", "--policy", "static", "--one-k-per-batch", "--db-url", sqlite_url]) == 2
    assert "--one-k-per-batch is a setting of the goodput policy" in capsys.readouterr().err


def test_a_negative_tail_weight_is_an_error_not_a_traceback(capsys: pytest.CaptureFixture[str],
                                                             sqlite_url: str) -> None:
    assert main(["sidecar", "--tail-weight", "-1", "--db-url", sqlite_url]) == 2
    assert "tail_weight must be a finite number >= 0, got -1.0" in capsys.readouterr().err


@pytest.mark.parametrize("raw", [b'{"version": 3, "entries": {}}', b"not json", b"\xff\xfe"])
def test_policy_show_on_a_bad_redis_value_is_an_error_not_a_traceback(capsys: pytest.CaptureFixture[str],
                                                                      redis_url: str, redis_prefix: str,
                                                                      raw: bytes) -> None:
    import redis

    from telemetry.transport import RedisKeys

    r = redis.Redis.from_url(redis_url)
    try:
        r.set(RedisKeys(redis_prefix).policy, raw)
        assert main(["policy", "show", "--redis-url", redis_url, "--prefix", redis_prefix]) == 2
        err = capsys.readouterr().err
        assert "is not a policy table spectune reads" in err and "Traceback" not in err
    finally:
        r.delete(RedisKeys(redis_prefix).policy)
        r.close()
