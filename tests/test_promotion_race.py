"""Two registers finishing together, against a real `mlflow server` on loopback (two server processes, so
their requests run at once): the champion alias ends where the promotion rules put it, as if the two
promotions had run one after the other. Without the registry's promotion lock both read the same champion
(or none), both decide `champion`, and the later write wins over a version it never compared with."""

import threading
import time

import pytest

from conftest import mlflow_server

from stages.register import promote
from stages.tracking.registry import CHALLENGER, CHAMPION, LOCK_HOLDER_TAG, LOCK_SUFFIX, TAG, promotion_lock

pytestmark = pytest.mark.slow
ROUNDS = 3  # each a new model: the race is exercised several times, not once by luck


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    with mlflow_server(tmp_path_factory.mktemp("mlflow-race"), workers=2) as uri:
        yield uri


def client_for(uri: str):
    from mlflow.tracking import MlflowClient
    return MlflowClient(uri)


def new_model(uri: str, name: str, n: int) -> list[str]:
    """`n` versions of a new registered model, each tagged with its own train fingerprint `fp<version>`."""
    client = client_for(uri)
    client.create_registered_model(name)
    run = client.create_run(client.create_experiment(f"{name}-runs"))
    versions = []
    for _ in range(n):
        v = client.create_model_version(name, f"runs:/{run.info.run_id}/model", run_id=run.info.run_id)
        client.set_model_version_tag(name, v.version, TAG + "train_fingerprint", f"fp{v.version}")
        versions.append(str(v.version))
    return versions


def at_once(uri: str, calls: list) -> list:
    """Runs each `call(client)` in a thread of its own, all released together; their results in order."""
    barrier = threading.Barrier(len(calls))
    results: list = [None] * len(calls)
    errors: list = []

    def go(i, call):
        client = client_for(uri)
        barrier.wait()
        try:
            results[i] = call(client)
        except Exception as e:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(e)
    threads = [threading.Thread(target=go, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return results


def aliases(uri: str, name: str) -> dict[str, str]:
    return {alias: str(v) for alias, v in (client_for(uri).get_registered_model(name).aliases or {}).items()}


def test_two_first_registers_at_once_make_one_champion(registry):
    """No champion yet, both finish together: one becomes champion ("no champion yet"); the other then finds a
    champion it did not compare with and is held back as challenger."""
    for r in range(ROUNDS):
        name = f"race-first-{r}"
        a, b = new_model(registry, name, 2)
        out = at_once(registry, [lambda c, v=v, name=name: promote(c, name, v, f"fp{v}", "if_better", None, "val")
                                 for v in (a, b)])
        decided = {v: o[0] for v, o in zip((a, b), out)}
        assert sorted(decided.values()) == [CHALLENGER, CHAMPION], (r, out)
        winner = next(v for v, d in decided.items() if d == CHAMPION)
        loser = b if winner == a else a
        assert aliases(registry, name) == {CHAMPION: winner, CHALLENGER: loser}, (r, out)
        reasons = {v: client_for(registry).get_model_version(name, v).tags[TAG + "alias_reason"] for v in (a, b)}
        assert reasons[winner] == "no champion yet"
        assert f"champion v{winner} was not compared in this run" in reasons[loser]


def test_two_better_versions_at_once_move_the_champion_once(registry):
    """v1 is champion; v2 and v3 were both compared with it and both beat it. In order, the first takes the
    alias; the second then meets a champion it never compared with, and stays challenger: the alias never
    lands on a version that was not compared with the champion it replaced."""
    for r in range(ROUNDS):
        name = f"race-better-{r}"
        v1, v2, v3 = new_model(registry, name, 3)
        assert promote(client_for(registry), name, v1, "fp1", "if_better", None, "val")[0] == CHAMPION
        vs = {"version": v1, "train_fingerprint": "fp1", "accuracy": 0.5, "delta": 0.25}
        out = at_once(registry, [lambda c, v=v, name=name, vs=vs: promote(c, name, v, f"fp{v}", "if_better", vs, "val")
                                 for v in (v2, v3)])
        decided = {v: o[0] for v, o in zip((v2, v3), out)}
        assert sorted(decided.values()) == [CHALLENGER, CHAMPION], (r, out)
        winner = next(v for v, d in decided.items() if d == CHAMPION)
        assert aliases(registry, name) == {CHAMPION: winner, CHALLENGER: v3 if winner == v2 else v2}, (r, out)


def test_a_dead_holders_lock_is_broken_and_a_live_one_is_waited_for(registry):
    client = client_for(registry)
    name = "race-lock"
    lock = name + LOCK_SUFFIX
    client.create_registered_model(lock, tags={LOCK_HOLDER_TAG: "dead-host:1:gone"})  # a holder SIGKILLed
    t0 = time.monotonic()
    with promotion_lock(client, name, stale_s=1.0, poll_s=0.1) as me:
        assert time.monotonic() - t0 >= 1.0
        assert client.get_registered_model(lock).tags[LOCK_HOLDER_TAG] == me
        with pytest.raises(RuntimeError, match="was not released"):  # held: another caller waits, then gives up
            with promotion_lock(client_for(registry), name, wait_s=0.5, stale_s=60, poll_s=0.1):
                pass
    names = {m.name for m in client.search_registered_models(f"name LIKE '{name}%'")}
    assert names == set(), names  # released, and the broken one deleted
