"""fleet.yaml parsing: the repo's example, good and bad fixtures (each bad one names its line
and field), a fuzz rule, and `diff`."""

from __future__ import annotations

import dataclasses
import random
import re
from pathlib import Path

import pytest

from supervisor.fleet_config import (
    BACKENDS,
    CheckpointPaths,
    ExplicitStage,
    FleetConfigError,
    diff,
    load_fleet_config,
    parse_fleet_config,
)

FIXTURES = Path(__file__).parent / "fixtures"
REPO_FLEET = Path(__file__).parents[2] / "fleet.yaml"
EXPECT = re.compile(r"^# expect: (\d+) ?(\S*) \| (.+)$")
BAD = sorted(FIXTURES.glob("bad-*.yaml"))


def test_repo_fleet_yaml_parses():
    fleet = load_fleet_config(REPO_FLEET)
    assert fleet.version == 1
    assert fleet.supervisor.address == "192.168.1.10:7400"
    assert [n.name for n in fleet.nodes] == ["gb10", "mac-studio"]
    assert dict(fleet.node("gb10").labels) == {"room": "lab"}
    model = fleet.model("qwen3-8b")
    assert model.checkpoint.path_for("mac-studio") == "/Users/me/models/Qwen3-8B"
    assert model.backends == ("torch-cuda", "mlx-metal")
    assert (model.context, model.parallel, model.chunk) == (8192, 4, 512)
    assert model.objective == "decode" and model.placement_is_auto and model.rank0 == "gb10"


def test_good_full_fixture():
    fleet = load_fleet_config(FIXTURES / "good-full.yaml")
    assert fleet.supervisor.address == "[fd00::1]:7400"
    assert fleet.supervisor.state_dir == "~/ringfleet-state"
    assert dict(fleet.node("gb10").labels) == {"backend": "torch-cuda", "room": "2"}
    assert dict(fleet.node("gb10").pins) == {"usable_memory_gb": "100"}
    assert fleet.node("mac-studio").labels == ()
    llama, qwen = fleet.models
    assert (llama.context, llama.parallel, llama.chunk) == (4096, 2, 256)  # merged from &shape
    assert llama.checkpoint == CheckpointPaths(all_nodes="/models/Llama-3.1-8B")
    assert llama.checkpoint.path_for("mac-mini") == "/models/Llama-3.1-8B"
    # An unquoted 0:20 is YAML 1.1's base-60 integer 20; the raw text is read instead.
    assert llama.placement == (ExplicitStage("gb10", (0, 20), "torch-cuda"),
                               ExplicitStage("mac-studio", (20, 32)))
    assert llama.objective == "prompt" and llama.rank0 == "gb10"
    assert qwen.id == "Qwen/Qwen3-0.6B" and qwen.backends == BACKENDS
    assert qwen.checkpoint.path_for("mac-studio") is None
    assert (qwen.parallel, qwen.chunk, qwen.objective, qwen.rank0) == (1, 512, "decode", None)


def test_good_minimal_fixture_has_no_models():
    fleet = load_fleet_config(FIXTURES / "good-minimal.yaml")
    assert fleet.models == () and fleet.nodes[0].name == "solo"


@pytest.mark.parametrize("path", BAD, ids=[p.stem for p in BAD])
def test_bad_fixture_names_line_and_field(path: Path):
    line, field, fragment = EXPECT.match(path.read_text().splitlines()[0]).groups()
    with pytest.raises(FleetConfigError) as caught:
        load_fleet_config(path)
    err = caught.value
    assert (err.line, err.field) == (int(line), field), str(err)
    prefix = f"{path}:{line}: {field}: " if field else f"{path}:{line}: "
    assert str(err).startswith(prefix), str(err)
    assert fragment in str(err)


def test_message_shape_matches_the_design():
    text = (FIXTURES / "bad-context-negative.yaml").read_text()
    with pytest.raises(FleetConfigError) as caught:
        parse_fleet_config(text, "fleet.yaml")
    assert str(caught.value) == ("fleet.yaml:11: models[0].context: "
                                 "expected a positive integer, got -5")
    assert caught.value.value == -5


def test_unreadable_file_is_a_fleet_config_error(tmp_path: Path):
    with pytest.raises(FleetConfigError, match="cannot read"):
        load_fleet_config(tmp_path / "absent.yaml")


def test_any_mutation_parses_or_raises_fleet_config_error():
    text = REPO_FLEET.read_text()
    rng = random.Random(6)
    alphabet = " \n:-[]{}#&*!|>'\",?0123456789abcxyz\t@`%<"
    for _ in range(600):
        chars = list(text)
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(chars))
            op = rng.random()
            if op < 0.4:
                chars[i] = rng.choice(alphabet)
            elif op < 0.7:
                del chars[i]
            else:
                chars.insert(i, rng.choice(alphabet))
        try:
            parse_fleet_config("".join(chars), "fuzz.yaml")
        except FleetConfigError as exc:
            assert str(exc).startswith("fuzz.yaml")


@pytest.mark.parametrize("snippet,line,fragment", [
    ("x-base: 5\nsupervisor:\n  <<: 5\n", 4, "cannot merge"),
    ("supervisor:\n  address: !!int x\n  state_dir: /s\n", 3, "cannot read 'x'"),
    ("supervisor:\n  address: !custom x\n  state_dir: /s\n", 3, "cannot read 'x'"),
])
def test_yaml_tags_and_merges_are_fleet_config_errors(snippet, line, fragment):
    with pytest.raises(FleetConfigError) as caught:
        parse_fleet_config("version: 1\n" + snippet + "nodes: [{name: a}]\n")
    assert caught.value.line == line and fragment in str(caught.value)


def test_diff_of_a_file_with_itself_is_empty():
    fleet = load_fleet_config(REPO_FLEET)
    assert diff(fleet, fleet) == []


def test_diff_names_every_change():
    old = load_fleet_config(REPO_FLEET)
    text = (REPO_FLEET.read_text()
            .replace("context: 8192", "context: 16384")
            .replace("parallel: 4 ", "parallel: 8 ")
            .replace("labels: {room: office}", "labels: {room: hall}")
            .replace("address: 192.168.1.10:7400", "address: 192.168.1.11:7400")
            .replace("    placement: auto ",
                     "    placement: [{node: gb10, layers: '0:20'}, "
                     "{node: mac-studio, layers: '20:36'}] ")
            .replace("models:\n", "models:\n  - {id: tiny, checkpoint: /m/tiny, context: 64}\n")
            .replace("\nmodels:", "\n  - name: pi5\nmodels:"))
    new = parse_fleet_config(text)
    assert diff(old, new) == [
        "supervisor.address: 192.168.1.10:7400 -> 192.168.1.11:7400",
        "node added: pi5",
        "node mac-studio: labels {room: office} -> {room: hall}",
        "model added: tiny",
        "model qwen3-8b: context 8192 -> 16384",
        "model qwen3-8b: parallel 4 -> 8",
        "model qwen3-8b: placement auto -> gb10 0:20, mac-studio 20:36",
    ]
    back = diff(new, old)
    assert "node removed: pi5" in back and "model removed: tiny" in back


def test_diff_shows_checkpoint_and_backends():
    old = load_fleet_config(REPO_FLEET)
    model = dataclasses.replace(old.models[0], checkpoint=CheckpointPaths(all_nodes="/m/q"),
                                backends=("torch-cuda",))
    new = dataclasses.replace(old, models=(model,))
    assert diff(old, new) == [
        ("model qwen3-8b: checkpoint {gb10: /models/Qwen3-8B, mac-studio: "
         "/Users/me/models/Qwen3-8B} -> /m/q"),
        "model qwen3-8b: backends [torch-cuda, mlx-metal] -> [torch-cuda]",
    ]


# One model on one node; %s: more of the model's lines.
ONE_MODEL = """version: 1
supervisor: {address: "127.0.0.1:7400", state_dir: /tmp/x}
nodes: [{name: a}]
models:
  - id: m
    checkpoint: /m
    context: 64
%s"""
REPLICAS = ONE_MODEL % "    replicas: %s\n"


def test_replicas_is_a_count_or_auto_and_only_it_leaves_the_spec_digest_alone():
    from supervisor.fleet_config import AUTO_REPLICAS
    from supervisor.planning import spec_digest

    two, auto = (parse_fleet_config(REPLICAS % v).model("m") for v in ("2", "auto"))
    assert two.replicas == 2 and auto.replicas == AUTO_REPLICAS and auto.replicas_are_auto
    one = parse_fleet_config((REPLICAS % "1").replace("    replicas: 1\n", "")).model("m")
    assert one.replicas == 1
    assert spec_digest(one) == spec_digest(two) == spec_digest(auto)
    changes = diff(parse_fleet_config(REPLICAS % "2"), parse_fleet_config(REPLICAS % "auto"))
    assert changes == ["model m: replicas 2 -> auto"]
    for bad in ("0", "-1", "many", "true", "1.5"):
        with pytest.raises(FleetConfigError, match=r":8: models\[0\]\.replicas: expected a "
                                                   "positive integer or 'auto'"):
            parse_fleet_config(REPLICAS % bad)


PROMPT_CACHE = ONE_MODEL % "%s"


def test_prompt_cache_bytes_is_a_size_and_the_slots_override_it():
    from supervisor.planning import spec_digest

    def model(lines: str):
        return parse_fleet_config(PROMPT_CACHE % lines).model("m")

    unset = model("")
    assert (unset.prompt_cache_slots, unset.prompt_cache_bytes) == (None, None)
    for text, expected in (("4GiB", 4 << 30), ("1.5 GB", 1_500_000_000), ("512MiB", 512 << 20),
                           ("1048576", 1 << 20), ("0", 0), ("2 kB", 2000)):
        assert model(f"    prompt_cache_bytes: {text}\n").prompt_cache_bytes == expected, text
    both = model("    prompt_cache_bytes: 1GiB\n    prompt_cache_slots: 3\n")
    assert (both.prompt_cache_slots, both.prompt_cache_bytes) == (3, 1 << 30)
    # Unset fields leave the digest as it was before they existed; a set one changes it.
    assert spec_digest(unset) != spec_digest(model("    prompt_cache_bytes: 1GiB\n"))
    assert spec_digest(unset) != spec_digest(model("    prompt_cache_slots: 8\n"))
    assert diff(parse_fleet_config(PROMPT_CACHE % ""),
                parse_fleet_config(PROMPT_CACHE % "    prompt_cache_bytes: 1GB\n")) == [
        "model m: prompt_cache_bytes none -> 1000000000"]
    for bad in ("-1", "-1GiB", "1.5", "4gib", "lots", "true", "~", "[1]", "1 GiBs"):
        with pytest.raises(FleetConfigError, match=r":8: models\[0\]\.prompt_cache_bytes: "
                                                   "expected a size in bytes"):
            model(f"    prompt_cache_bytes: {bad}\n")
    with pytest.raises(FleetConfigError, match=r":8: models\[0\]\.prompt_cache_slots: "
                                               "expected an integer >= 0, got -2"):
        model("    prompt_cache_slots: -2\n")


def test_kv_pages_is_a_pool_of_at_least_one_whole_context():
    from supervisor.planning import spec_digest

    def model(lines: str):  # a context of 1000 positions: 16 pages of 64
        return parse_fleet_config(PROMPT_CACHE.replace("context: 64", "context: 1000")
                                  % lines).model("m")

    unset = model("")
    assert unset.kv_pages == 0 and model("    kv_pages: 0\n") == unset
    assert model("    kv_pages: 16\n").kv_pages == 16
    assert model("    kv_pages: 4096\n").kv_pages == 4096
    # Whole windows leave the digest as it was before the field existed; a pool changes it.
    assert spec_digest(model("    kv_pages: 16\n")) != spec_digest(unset)
    assert diff(parse_fleet_config(PROMPT_CACHE % ""),
                parse_fleet_config(PROMPT_CACHE % "    kv_pages: 2\n")) == [
        "model m: kv_pages 0 -> 2"]
    with pytest.raises(FleetConfigError, match=re.escape(
            ":8: models[0].kv_pages: a pool of 15 pages (960 positions) is smaller than one "
            "whole context of 1000 positions (16 pages of 64): a request that leaves "
            "max_tokens out reserves the whole context and could never be admitted; set at "
            "least 16, 0 for a whole context a slot, or a smaller context")):
        model("    kv_pages: 15\n")
    for bad in ("-1", "many", "true", "1.5", "~"):
        with pytest.raises(FleetConfigError, match=r":8: models\[0\]\.kv_pages: expected an "
                                                   "integer >= 0, got"):
            model(f"    kv_pages: {bad}\n")


KERNELS = ONE_MODEL % "    kernels:\n%s"


def test_kernels_are_the_engines_knobs_kept_only_where_they_differ_from_its_defaults():
    from engine.env import KERNEL_KNOBS, EngineEnv
    from supervisor.planning import spec_digest

    def model(lines: str):
        return parse_fleet_config(KERNELS % lines).model("m")

    every = ("      packed_kernel: int4\n      quant: dense\n      compile: off\n"
             "      delta_kernel: torch\n      cuda_graphs: false\n"
             "      decode_attention: sdpa\n      prompt_attention: cudnn\n")
    # In the engine's order whatever the file's; `off` read as written, not as YAML's false.
    assert model(every).kernels == (("quant", "dense"), ("compile", "off"),
                                    ("delta_kernel", "torch"), ("decode_attention", "sdpa"),
                                    ("packed_kernel", "int4"), ("prompt_attention", "cudnn"),
                                    ("cuda_graphs", False))
    assert [attr for attr, _ in model(every).kernels] == list(KERNEL_KNOBS)
    assert model("      compile: on\n").kernels == (("compile", "on"),)
    # Every knob at the engine's default is no setting at all: the spec (and its digest) of
    # a file without `kernels:`.
    defaults = "".join(
        f"      {attr}: {str(EngineEnv.__dataclass_fields__[attr].default).lower()}\n"
        for attr in KERNEL_KNOBS)
    unset = parse_fleet_config(ONE_MODEL % "").model("m")
    assert model(defaults) == unset and unset.kernels == ()
    assert parse_fleet_config(ONE_MODEL % "    kernels: {}\n").model("m") == unset
    assert spec_digest(model("      quant: dense\n")) != spec_digest(unset)
    assert diff(parse_fleet_config(ONE_MODEL % ""),
                parse_fleet_config(KERNELS % "      cuda_graphs: no\n      quant: dense\n")) == [
        "model m: kernels {} -> {cuda_graphs: false, quant: dense}"]


@pytest.mark.parametrize("lines,message", [
    ("      quant: int8\n",
     ("fleet.yaml:9: models[0].kernels.quant: unknown quant 'int8' "
      "(expected one of auto, packed, dense)")),
    ("      compile: yes\n",
     ("fleet.yaml:9: models[0].kernels.compile: unknown compile 'yes' "
      "(expected one of auto, off, on)")),
    ("      delta_kernel: [fla]\n",
     ("fleet.yaml:9: models[0].kernels.delta_kernel: unknown delta kernel a list "
      "(expected one of auto, torch, fla)")),
    ("      decode_attention: flash\n",
     ("fleet.yaml:9: models[0].kernels.decode_attention: unknown decode attention 'flash' "
      "(expected one of triton, sdpa)")),
    ("      quant: dense\n      packed_kernel: ''\n",
     ("fleet.yaml:10: models[0].kernels.packed_kernel: unknown packed kernel '' "
      "(expected one of triton, int4)")),
    ("      cuda_graphs: 0\n",
     "fleet.yaml:9: models[0].kernels.cuda_graphs: expected true or false, got 0"),
    ("      cuda_graph: false\n",
     ("fleet.yaml:9: models[0].kernels.cuda_graph: unknown field (did you mean "
      "'cuda_graphs'?); known fields: quant, compile, delta_kernel, decode_attention, "
      "packed_kernel, prompt_attention, cuda_graphs")),
    ("      - quant\n",
     "fleet.yaml:9: models[0].kernels: expected a mapping, got a list"),
])
def test_a_bad_kernel_setting_names_its_line_field_and_the_engines_spellings(lines, message):
    with pytest.raises(FleetConfigError) as caught:
        parse_fleet_config(KERNELS % lines)
    assert str(caught.value) == message


def test_the_kernel_spellings_fleet_yaml_accepts_are_the_engines():
    from engine.env import KERNEL_CHOICES

    for attr, allowed in KERNEL_CHOICES.items():
        for value in allowed:
            assert parse_fleet_config(KERNELS % f"      {attr}: '{value}'\n")
        with pytest.raises(FleetConfigError, match=f"expected one of {', '.join(allowed)}"):
            parse_fleet_config(KERNELS % f"      {attr}: nope\n")


def test_a_models_drafter_is_read_as_written_and_bounded_by_the_verify_round():
    def model(lines: str):
        return parse_fleet_config(ONE_MODEL % lines).model("m")

    unset = model("")
    assert (unset.drafter, unset.draft_tokens) == ("off", 5)
    assert model("    drafter: off\n") == unset  # YAML's false, read as the word written
    spec = model("    drafter: ngram\n    draft_tokens: 7\n")
    assert (spec.drafter, spec.draft_tokens) == ("ngram", 7)
    assert model("    drafter: mtp\n    draft_tokens: 3\n").drafter == "mtp"
    for lines, message in (
            ("    drafter: eagle\n",
             "models[0].drafter: unknown drafter 'eagle' (expected one of off, ngram, mtp)"),
            ("    drafter: ngram\n    draft_tokens: 8\n",
             "models[0].draft_tokens: a verify round carries at most 7 drafts, not 8"),
            ("    draft_tokens: 0\n", "models[0].draft_tokens: expected a positive integer, got 0")):
        with pytest.raises(FleetConfigError, match=re.escape(message)):
            model(lines)
    from supervisor.planning import spec_digest
    assert spec_digest(model("    draft_tokens: 3\n")) == spec_digest(unset)
    assert spec_digest(spec) != spec_digest(unset)
