"""An apply's decision of what changed (supervisor.operator_commands.what_changes), pure:
the lines the operator reads, and the only models planned again."""

from __future__ import annotations

from supervisor.operator_commands import what_changes
from tests.supervisor.test_lifecycle import config


def test_a_first_apply_plans_every_model():
    changes, changed = what_changes(None, config())
    assert changes == ["first apply: 1 model(s), 2 node(s)"] and changed == {"demo"}


def test_the_same_file_again_changes_nothing_and_plans_nothing():
    assert what_changes(config(), config()) == ([], set())


def test_a_changed_model_is_planned_again_and_named():
    changes, changed = what_changes(config(parallel=2), config(parallel=3))
    assert changed == {"demo"}
    assert any("parallel" in line and "2" in line and "3" in line for line in changes), changes
