"""supervisor.planning's spec digest: canonical JSON, so it changes exactly when the spec does."""

from __future__ import annotations

import hashlib
from dataclasses import replace

from supervisor.fleet_config import CheckpointPaths, ExplicitStage, ModelSpec
from supervisor.planning import spec_digest

SPEC = ModelSpec("m", CheckpointPaths(all_nodes="/ckpt"), ("torch-cpu",), 64,
                 placement=(ExplicitStage("a", (0, 2)),))


def test_the_digest_is_of_canonical_json():
    spec = ModelSpec("m", CheckpointPaths(all_nodes="/c"), ("mlx-cpu",), 8)
    canonical = ('{"backends":["mlx-cpu"],"checkpoint":{"all_nodes":"/c","by_node":[]},'
                 '"chunk":512,"context":8,"id":"m","objective":"decode","parallel":1,'
                 '"placement":[],"rank0":null}')
    assert spec_digest(spec) == hashlib.sha256(canonical.encode()).hexdigest()[:16]


def test_the_digest_changes_with_every_field_and_only_then():
    assert spec_digest(SPEC) == spec_digest(replace(SPEC))
    changed = [replace(SPEC, id="n"), replace(SPEC, context=65), replace(SPEC, parallel=2),
               replace(SPEC, chunk=1), replace(SPEC, objective="prompt"),
               replace(SPEC, backends=("mlx-cpu",)), replace(SPEC, rank0="a"),
               replace(SPEC, checkpoint=CheckpointPaths(by_node=(("a", "/x"),))),
               replace(SPEC, placement=(ExplicitStage("a", (0, 3)),))]
    digests = {spec_digest(s) for s in changed}
    assert len(digests) == len(changed) and spec_digest(SPEC) not in digests
