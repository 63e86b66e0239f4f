"""fleetctl's options and credentials: the common options after the command as well as
before it, and one credentials directory per fleet (the old single one still read)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from engine.harness.launch import free_port
from supervisor.fleetctl import build_parser, main, speed_line


@pytest.mark.parametrize("argv", [["--json", "status"], ["status", "--json"],
                                  ["apply", "f.yaml", "--json"], ["drain", "n", "--json"],
                                  ["token", "--node", "n", "--json"], ["rebalance", "--json"]])
def test_json_is_taken_before_or_after_every_command(argv):
    assert build_parser().parse_args(argv).json is True


def test_an_option_after_the_command_wins_and_one_before_it_is_kept():
    args = build_parser().parse_args(["--supervisor", "https://a:1", "status"])
    assert args.supervisor == "https://a:1" and args.json is False and args.fleet is None
    args = build_parser().parse_args(["--supervisor", "https://a:1", "status",
                                      "--supervisor", "https://b:2", "--fleet", "x"])
    assert (args.supervisor, args.fleet) == ("https://b:2", "x")


@pytest.fixture
def home(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("FLEETCTL_DIR", raising=False)
    monkeypatch.delenv("FLEETCTL_FLEET", raising=False)
    return tmp_path / "home"


def tried(capsys, argv: list[str]) -> str:
    """Run fleetctl, which must fail to reach the supervisor (nothing listens there): the
    port of the URL it tried, which says whose credentials it read."""
    assert main(argv) == 3
    message = capsys.readouterr().err
    assert "cannot reach the supervisor at https://127.0.0.1:" in message, message
    return message.split("https://127.0.0.1:")[1].split(":")[0]


def test_two_fleets_on_one_machine_keep_their_credentials_apart(tmp_path, home, capsys):
    ports = [free_port(), free_port()]
    for i, port in enumerate(ports):
        assert main(["init", "--state-dir", str(tmp_path / f"s{i}"),
                     "--address", f"127.0.0.1:{port}"]) == 0
    fleets = home / ".config/ringfleet/fleetctl/fleets"
    dirs = sorted(p.name for p in fleets.iterdir())
    assert dirs == sorted(f"127.0.0.1_{p}" for p in ports)
    cas = {(fleets / d / "ca.pem").read_bytes() for d in dirs}
    assert len(cas) == 2  # neither init overwrote the other's CA
    capsys.readouterr()

    assert main(["status"]) == 2
    assert "several fleets" in capsys.readouterr().err
    assert tried(capsys, ["status", "--fleet", f"127.0.0.1:{ports[0]}"]) == \
        str(ports[0])
    assert tried(capsys, ["--supervisor", f"https://127.0.0.1:{ports[1]}",
                                   "status", "--json"]) == str(ports[1])


def test_the_old_single_fleet_location_is_still_read(tmp_path, home, capsys):
    port = free_port()
    assert main(["init", "--state-dir", str(tmp_path / "s"), "--address",
                 f"127.0.0.1:{port}"]) == 0
    base = home / ".config/ringfleet/fleetctl"
    for path in (base / "fleets" / f"127.0.0.1_{port}").iterdir():
        shutil.move(str(path), base / path.name)  # as fleetctl kept it before fleets
    shutil.rmtree(base / "fleets")
    capsys.readouterr()
    assert tried(capsys, ["status"]) == str(port)
    assert tried(capsys, ["status", "--supervisor", f"https://127.0.0.1:{port}"]) == \
        str(port)


def test_out_writes_a_secret_owner_only_even_over_a_wider_file(tmp_path):
    from supervisor.fleetctl import CtlError, write_secret

    assert build_parser().parse_args(["token", "--node", "n", "--out", "t"]).out == Path("t")
    old = tmp_path / "n.token"
    old.write_text("an older token\n")
    old.chmod(0o644)  # what `fleetctl token > n.token` made
    write_secret(old, "rf1.abc.def")
    assert old.read_text() == "rf1.abc.def\n" and old.stat().st_mode & 0o777 == 0o600
    assert not list(tmp_path.glob("*.tmp"))
    (tmp_path / "file").write_text("")
    with pytest.raises(CtlError) as refused:  # a parent that is a file: a named error, code 2
        write_secret(tmp_path / "file" / "n.token", "x")
    assert refused.value.code == 2 and "--out" in str(refused.value)


def test_a_speed_far_off_its_prediction_suggests_measuring_again():
    def speed(error_pct: float, rounds: int) -> dict:
        return {"predicted_ms_per_token": 50.0, "predicted_ms_per_token_parallel": 60.0,
                "parallel": 2, "measured": {"1": {
                    "ms_per_token": 40.0, "rounds": rounds, "predicted_ms_per_token": 50.0,
                    "error_pct": error_pct}}}

    hint = "`fleetctl remeasure NODE`"
    assert hint in speed_line(speed(+25.0, 40)) and hint in speed_line(speed(-20.0, 20))
    assert hint not in speed_line(speed(+19.9, 400))  # near enough
    assert hint not in speed_line(speed(+60.0, 19))  # too few rounds to say
