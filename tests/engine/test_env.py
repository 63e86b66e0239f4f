"""The environment contract (engine.env) and the address rule (engine.addresses): what one
writes the other reads back, and every refusal names the variable to fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.addresses import AddressError, format_host_port, listen_address, parse_host_port
from engine.env import (
    KERNEL_CHOICES,
    KERNEL_KNOBS,
    SWITCHES,
    TUNING,
    VARIABLE_OF,
    VARIABLES,
    EngineEnv,
    EnvError,
    placement_id,
    read_switch,
)


@pytest.mark.parametrize(("text", "parsed"), [
    ("127.0.0.1:8000", ("127.0.0.1", 8000)), ("[::1]:9", ("::1", 9)),
    ("node-a.lan:65535", ("node-a.lan", 65535)), (":0", ("", 0)),
])
def test_host_port_reads_back_what_it_writes(text, parsed):
    assert parse_host_port(text, "X") == parsed
    assert parse_host_port(format_host_port(*parsed), "X") == parsed
    assert format_host_port("[::1]", 9) == format_host_port("::1", 9) == "[::1]:9"


@pytest.mark.parametrize("text", ["127.0.0.1", "h:port", "h:65536", "h:-1", "::1:8000",
                                  "fe80::1:80"])
def test_host_port_refuses_with_the_setting_named(text):
    with pytest.raises(AddressError, match=r"^SETTING="):
        parse_host_port(text, "SETTING")


def test_an_unbracketed_ipv6_host_is_refused_with_the_fix():
    with pytest.raises(AddressError, match=r"\[::1\]:8000"):
        parse_host_port("::1:8000", "FLEET_HTTP")


def test_min_port_and_listen_address():
    with pytest.raises(AddressError, match="port 1..65535"):
        parse_host_port("h:0", "listen", min_port=1)
    with pytest.raises(AddressError, match="wildcard"):
        listen_address("[::]:8000", "listen")
    assert listen_address("[::1]:8000", "listen") == ("::1", 8000)


def ring_env(tmp_path: Path) -> EngineEnv:
    secret = tmp_path / "api"
    secret.write_text("s" * 32)
    return EngineEnv(
        model_dir=tmp_path / "m", rank=0, world_size=2, master=("::1", 29601),
        layer_range=(0, 3), layout=((0, 3), (3, 4)), backend="mlx-cpu",
        listen=("127.0.0.1", 29602), key_file=tmp_path / "k",
        placement=placement_id([(0, 3), (3, 4)], ["mlx-cpu", "torch-cpu"]),
        http=("::1", 29603), context=64, parallel=2, chunk=16, max_waiting=0, model_id="m",
        drain_s=0.25, keepalive_s=0.5, dead_after=5, round_deadline_s=7.5,
        boot_deadline_s=9.0, handshake_deadline_s=1.5, cpu_threads=2, log_level="debug",
        cuda_graphs=False, compile="on", decode_attention="sdpa", packed_kernel="int4",
        api_secret_file=secret, api_secret="s" * 32,
        http_max_connections=10, http_header_s=1.0, http_idle_s=2.0, http_body_s=3.0)


def test_the_contract_reads_back_what_it_writes(tmp_path):
    env = ring_env(tmp_path)
    written = env.to_environ()
    assert written["FLEET_PLACEMENT"] == "0-3@mlx-cpu,3-4@torch-cpu"
    assert written["FLEET_LAYOUT"] == "0:3,3:4" and written["FLEET_HTTP"] == "[::1]:29603"
    assert written["FLEET_DRAIN_S"] == "0.25"  # fractions pass as they are
    assert "s" * 32 not in written.values()  # the secret travels by its file only
    assert EngineEnv.from_environ(written) == env


def test_a_standalone_contract_reads_back_too(tmp_path):
    env = EngineEnv(model_dir=tmp_path, http=("127.0.0.1", 8001), model_id="x")
    written = env.to_environ()
    assert EngineEnv.from_environ(written) == env
    # knobs at their defaults are left to the engine (and to the caller's environment)
    assert "FLEET_LOG_LEVEL" not in written and "FLEET_DRAIN_S" not in written
    assert set(written) == {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "FLEET_MODEL",
                            "FLEET_BACKEND", "FLEET_PLACEMENT", "FLEET_CONTEXT",
                            "FLEET_PARALLEL", "FLEET_CHUNK", "FLEET_HTTP", "FLEET_MODEL_ID"}


@pytest.mark.parametrize(("variable", "value"), [
    ("RANK", "2"), ("FLEET_BACKEND", "torch-tpu"), ("FLEET_LAYOUT", "0:1,1:4"),
    ("FLEET_LISTEN", "0.0.0.0:1"), ("FLEET_HTTP", "::1:80"), ("FLEET_DRAIN_S", "-1"),
    ("MASTER_PORT", "x"), ("FLEET_LOG_LEVEL", "loud"), ("FLEET_LAYERS", "3:3"),
    ("FLEET_COMPILE", "always"), ("FLEET_DECODE_ATTENTION", "flash"),
    ("FLEET_PACKED_KERNEL", "int8"),
])
def test_each_refusal_names_its_variable(tmp_path, variable, value):
    written = ring_env(tmp_path).to_environ()
    written[variable] = value
    with pytest.raises(EnvError) as refused:
        EngineEnv.from_environ(written)
    expected = "MASTER_ADDR:MASTER_PORT" if variable == "MASTER_PORT" else variable
    assert refused.value.variable == expected and str(refused.value).startswith(expected)


class Reads(dict):
    """A mapping that notes every name asked of it."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.asked: set[str] = set()

    def get(self, key, default=None):
        self.asked.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.asked.add(key)
        return super().__getitem__(key)


def test_the_contracts_names_are_the_ones_it_reads_and_writes(tmp_path):
    env = ring_env(tmp_path)
    written = env.to_environ()
    assert set(written) <= VARIABLES
    reads = Reads(written)
    EngineEnv.from_environ(reads, read_secret=False)
    assert reads.asked == VARIABLES  # a rank 0 of a ring asks for every variable there is
    # every field but the secret itself has its variable, and the two name the same fields
    assert set(VARIABLE_OF) == set(EngineEnv.__dataclass_fields__) - {"api_secret"}
    assert all(VARIABLE_OF[attr] == variable for variable, attr in TUNING.items())


def test_a_run_record_reads_back_without_its_secret_file(tmp_path):
    written = ring_env(tmp_path).to_environ()
    (tmp_path / "api").unlink()
    with pytest.raises(EnvError, match="cannot read the API secret"):
        EngineEnv.from_environ(written)
    kept = EngineEnv.from_environ(written, read_secret=False)
    assert (kept.api_secret_file, kept.api_secret) == (tmp_path / "api", "")


def test_the_kernel_switches_are_the_contracts_and_read_where_kernels_are_picked(tmp_path):
    env = EngineEnv(model_dir=tmp_path)
    assert "FLEET_DECODE_ATTENTION" not in env.to_environ()  # the defaults go unwritten
    for attr, allowed in SWITCHES.items():
        assert EngineEnv.__dataclass_fields__[attr].default == allowed[0]
        assert read_switch(attr, {}) == allowed[0]
    switched = EngineEnv(model_dir=tmp_path, decode_attention="sdpa", packed_kernel="int4")
    written = switched.to_environ()
    assert (written["FLEET_DECODE_ATTENTION"], written["FLEET_PACKED_KERNEL"]) == ("sdpa", "int4")
    assert read_switch("decode_attention", written) == "sdpa"
    assert read_switch("packed_kernel", written) == "int4"
    with pytest.raises(EnvError, match=r"^FLEET_PACKED_KERNEL='int8': expected one of "
                                       r"triton, int4$"):
        read_switch("packed_kernel", {"FLEET_PACKED_KERNEL": "int8"})


def test_the_kernel_knobs_default_to_their_first_spelling_and_each_is_read_back(tmp_path):
    # fleet.yaml and calibration requests check their kernel settings against KERNEL_CHOICES:
    # its defaults must be the engine's, and every spelling one the engine reads.
    fields_ = EngineEnv.__dataclass_fields__
    assert set(KERNEL_KNOBS) == set(KERNEL_CHOICES) | {"cuda_graphs"}
    assert all(attr in TUNING.values() for attr in KERNEL_KNOBS)
    for attr, allowed in KERNEL_CHOICES.items():
        assert fields_[attr].default == allowed[0]
        for value in allowed:
            env = EngineEnv(model_dir=tmp_path, **{attr: value})
            assert getattr(EngineEnv.from_environ(env.to_environ()), attr) == value
        with pytest.raises(EnvError) as refused:
            EngineEnv.from_environ(env.to_environ() | {VARIABLE_OF[attr]: "nope"})
        assert refused.value.variable == VARIABLE_OF[attr]
        assert str(refused.value).endswith(f"expected one of {', '.join(allowed)}")


def test_written_spells_a_knob_at_its_default_too(tmp_path):
    env = EngineEnv(model_dir=tmp_path, http=("127.0.0.1", 8001), model_id="x")
    assert "FLEET_DRAIN_S" not in env.to_environ()
    assert env.written("drain_s", "cuda_graphs") == {"FLEET_DRAIN_S": "180.0",
                                                     "FLEET_CUDA_GRAPHS": "1"}
    assert EngineEnv.from_environ(env.to_environ() | env.written("drain_s")) == env
