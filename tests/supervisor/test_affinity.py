"""A conversation's turns go to the replica that holds it, while that one has a free slot."""

from __future__ import annotations

from supervisor.affinity import conversation_key
from supervisor.relays import Relays
from supervisor.route_table import ModelRoutes, ReplicaRoute, RouteTable

SYSTEM = {"role": "system", "content": "You are terse."}


def chat(*turns: str) -> dict:
    """A chat body as a client resends it: every earlier turn and its reply, then the new one."""
    messages = [SYSTEM]
    for i, text in enumerate(turns):
        if i:
            messages.append({"role": "assistant", "content": f"reply {i}"})
        messages.append({"role": "user", "content": text})
    return {"model": "m", "messages": messages}


def table(in_use: dict[str, int], parallel: int = 2) -> RouteTable:
    replicas = tuple(ReplicaRoute(name, f"http://127.0.0.1:{9000 + i}", slots_in_use=used)
                     for i, (name, used) in enumerate(in_use.items()))
    return RouteTable(models=(ModelRoutes("m", parallel=parallel, serving=True,
                                          replicas=replicas),))


def test_the_turns_of_one_conversation_share_a_key_and_others_do_not():
    key = conversation_key(chat("plan a trip"))
    assert key == conversation_key(chat("plan a trip", "and a hotel", "cheaper"))
    assert key != conversation_key(chat("write a poem"))
    assert conversation_key({"model": "m", "prompt": "x" * 5000}) == \
        conversation_key({"model": "m", "prompt": "x" * 5000 + " more"})
    assert conversation_key({"model": "m", "prompt": [1, 2, 3]}) != \
        conversation_key({"model": "m", "prompt": [1, 2, 4]})
    for body in ({"model": "m"}, {"model": "m", "messages": []}, {"model": "m", "prompt": ""},
                 {"model": "m", "messages": "not a list"}):
        assert conversation_key(body) is None


def test_a_conversation_stays_on_its_replica_while_it_has_room():
    relays, routes = Relays(), table({"m-g1": 0, "m-g2": 0, "m-g3": 0})
    key = conversation_key(chat("plan a trip"))
    home = routes.route("m", relays, 0, key).replica
    # Every turn counter (the round-robin among equals) sends it home, and the other
    # replicas stay behind it as fallbacks.
    for turn in range(6):
        route = routes.route("m", relays, turn, key)
        assert route.replica == home
        assert {r.replica for r in route.fallbacks} == {"m-g1", "m-g2", "m-g3"} - {home}
    # Home full: the request goes by free slots instead, home last.
    full = table({name: (2 if name == home else 0) for name in ("m-g1", "m-g2", "m-g3")})
    route = full.route("m", relays, 0, key)
    assert route.replica != home and route.fallbacks[-1].replica == home


def test_many_conversations_spread_over_the_replicas():
    relays, routes = Relays(), table({"m-g1": 0, "m-g2": 0})
    homes = [routes.route("m", relays, 0, conversation_key(chat(f"task {i}"))).replica
             for i in range(40)]
    assert 10 <= homes.count("m-g1") <= 30
