"""Only the gated flow moves the champion.

On a locked MLflow server set up as `quantloop serve` sets it up (its basic-auth app, its
ini, quantloop.identities.setup as the admin): the researcher's credentials get 403 for
every write to the guarded registered model; the promoter's promote flow copies a
passing candidate in and moves the alias. Retrain and backtest refuse a champion
without a passing promotion record. The credentials file: upgraded from the one-user
form, rotated.
"""

from __future__ import annotations

import base64
import json
import os
import stat
import urllib.error
import urllib.request
import uuid
from types import SimpleNamespace

import pytest
from mlflow.entities.model_registry import ModelVersion, ModelVersionTag
from pydantic import SecretStr

from quantloop import identities
from quantloop.blocks import MlflowTracking
from quantloop.tasks.records import promotion
from tests import servers


def version(tags: dict[str, str]) -> ModelVersion:
    return ModelVersion("m", "3", 0, tags=[ModelVersionTag(k, v) for k, v in tags.items()])


PASSED = {
    promotion.DECISION: "promoted",
    promotion.GATES: json.dumps({"markout": {"passed": True, "p_adjusted": 0.01},
                                 "reproduction": {"passed": True},
                                 "ladder": {"passed": True}}),  # fmt: skip
    promotion.PROMOTER: "promoter",
    promotion.SOURCE: "m-candidates/7",
}


def test_a_promotion_record_passes_only_whole():
    assert promotion.problems(version(PASSED)) == []
    assert promotion.problems(version({})) == [
        "promotion.decision is None, not 'promoted'", "no promotion.gates",
        "no promotion.promoter", "no promotion.source",
    ]  # fmt: skip
    refused = {**PASSED, promotion.DECISION: "refused"}
    assert promotion.problems(version(refused)) == [
        "promotion.decision is 'refused', not 'promoted'"
    ]
    skipped = json.loads(PASSED[promotion.GATES]) | {"reproduction": {"passed": None}}
    assert promotion.problems(version({**PASSED, promotion.GATES: json.dumps(skipped)})) == [
        "gates not passed: reproduction"
    ]
    with pytest.raises(promotion.Unpromoted, match=r"^m version 3 \(alias 'champion'\) has no "
                       r"passing promotion record \(no promotion.promoter\)"):  # fmt: skip
        promotion.require_promoted(version({**PASSED, promotion.PROMOTER: ""}), "alias 'champion'")


def test_a_one_user_credentials_file_is_upgraded_and_rotation_changes_every_secret(tmp_path):
    path = tmp_path / "serve" / "credentials.json"
    path.parent.mkdir()
    old = {"prefect_auth_string": "quantloop:abc", "mlflow_user": "quantloop",
           "mlflow_password": "old-admin-password"}  # fmt: skip
    path.write_text(json.dumps(old))
    os.chmod(path, 0o644)
    creds = identities.load(path)
    assert (creds.admin.username, creds.admin.password) == ("quantloop", "old-admin-password")
    assert creds.prefect_auth_string == "quantloop:abc"  # the Prefect side keeps its string
    assert {creds.researcher.username, creds.promoter.username} == {"researcher", "promoter"}
    assert len({creds.admin.password, creds.researcher.password, creds.promoter.password}) == 3
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert set(json.loads(path.read_text())["mlflow"]) == {"admin", "researcher", "promoter"}
    assert identities.load(path) == creds  # reused, not made again
    assert "old-admin-password" not in repr(creds)
    assert identities.read_for(tmp_path, "promoter") == creds.promoter

    rotated = identities.rotate(path)
    assert rotated.previous_admin_password == "old-admin-password"
    for role in ("admin", "researcher", "promoter"):
        assert rotated.mlflow(role).password != creds.mlflow(role).password
        assert rotated.mlflow(role).username == creds.mlflow(role).username
    assert rotated.prefect_auth_string != creds.prefect_auth_string
    assert identities.load(path) == rotated and stat.S_IMODE(path.stat().st_mode) == 0o600


def rest(uri: str, who: identities.Identity, path: str, body: dict, method: str = "POST") -> int:
    token = base64.b64encode(f"{who.username}:{who.password}".encode()).decode()
    request = urllib.request.Request(uri + path, data=json.dumps(body).encode(), method=method,
                                     headers={"Authorization": f"Basic {token}",
                                              "Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.fixture(scope="module")
def locked(tmp_path_factory):
    """A basic-auth MLflow server with `quantloop serve`'s ini, set up by serve's own step
    (users, models, grants); its credentials; tracking blocks of each identity."""
    folder = tmp_path_factory.mktemp("guard")
    creds = identities.load(folder / "credentials.json")
    with servers.mlflow_server(folder, credentials=(creds.admin.username,
                                                    creds.admin.password)) as uri:  # fmt: skip
        name = f"guard-{uuid.uuid4().hex[:8]}"
        block = MlflowTracking(tracking_uri=uri, experiment=name, registered_model=name)
        identities.setup(uri, creds, models=(name, block.candidates), experiment=name)

        def as_(who: identities.Identity) -> MlflowTracking:
            return block.model_copy(update={"username": who.username,
                                            "password": SecretStr(who.password)})  # fmt: skip

        yield SimpleNamespace(uri=uri, creds=creds, name=name, candidates=block.candidates,
                              researcher=as_(creds.researcher), promoter=as_(creds.promoter),
                              admin=as_(creds.admin), home=folder / "home")  # fmt: skip


@pytest.fixture(scope="module")
def candidates(locked, prefect_api):
    """Two research runs recorded as the researcher: test_audit's untrained and trained
    models on one pinned dataset, each a version of the candidates model."""
    from quantloop.flows.research import ResearchParams, research
    from tests.test_audit import TINY, TRAINED, UNTRAINED

    saved = {k: os.environ.pop(k, None)
             for k in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")}  # fmt: skip
    try:
        workspace = {"home": str(locked.home), "tracking": locked.researcher.model_dump()}
        workspace["tracking"]["password"] = locked.creds.researcher.password
        runs = [research(ResearchParams.model_validate({**TINY, "workspace": workspace,
                                                        "train": train}))
                for train in (UNTRAINED, TRAINED)]  # fmt: skip
    finally:
        for k, v in saved.items():
            if v is not None:
                os.environ[k] = v
    assert {r.registered_model for r in runs} == {locked.candidates}
    return SimpleNamespace(worse=runs[0], better=runs[1])


@pytest.mark.slow
@pytest.mark.server
def test_the_researcher_gets_403_for_every_write_to_the_guarded_model(locked, candidates):
    from mlflow.tracking import MlflowClient

    uri, name, researcher = locked.uri, locked.name, locked.creds.researcher
    admin = MlflowClient(uri)
    # the researcher registered the candidate; a copy in the guarded model, made by the
    # admin, is what an alias could be set on
    os.environ.update(MLFLOW_TRACKING_USERNAME=locked.creds.admin.username,
                      MLFLOW_TRACKING_PASSWORD=locked.creds.admin.password)  # fmt: skip
    copy = admin.copy_model_version(f"models:/{locked.candidates}/{candidates.worse.model_version}",
                                    name)  # fmt: skip
    admin.set_registered_model_alias(name, "guard-test", copy.version)
    alias = {"name": name, "alias": "champion", "version": copy.version}
    assert rest(uri, researcher, "/api/2.0/mlflow/registered-models/alias", alias) == 403
    assert rest(uri, researcher, "/api/2.0/mlflow/registered-models/alias",
                {"name": name, "alias": "guard-test"}, "DELETE") == 403  # fmt: skip
    source = f"models:/{locked.candidates}/{candidates.worse.model_version}"
    assert rest(uri, researcher, "/api/2.0/mlflow/model-versions/create",
                {"name": name, "source": source}) == 403  # fmt: skip
    assert rest(uri, researcher, "/api/2.0/mlflow/model-versions/set-tag",
                {"name": name, "version": copy.version, "key": promotion.DECISION,
                 "value": "promoted"}) == 403  # fmt: skip
    # while the candidates model is theirs to write
    assert rest(uri, researcher, "/api/2.0/mlflow/model-versions/set-tag",
                {"name": locked.candidates, "version": candidates.worse.model_version,
                 "key": "note", "value": "mine"}) == 200  # fmt: skip
    assert admin.get_registered_model(name).aliases == {"guard-test": copy.version}


@pytest.mark.slow
@pytest.mark.server
def test_an_alias_set_by_hand_is_refused_by_retrain_and_backtest(locked, candidates):
    from mlflow.tracking import MlflowClient

    from quantloop.flows.backtest import backtest
    from quantloop.flows.retrain import retrain
    from quantloop.tasks.runtime.workspace import Workspace

    os.environ.update(MLFLOW_TRACKING_USERNAME=locked.creds.admin.username,
                      MLFLOW_TRACKING_PASSWORD=locked.creds.admin.password)  # fmt: skip
    admin = MlflowClient(locked.uri)
    copy = admin.copy_model_version(f"models:/{locked.candidates}/{candidates.worse.model_version}",
                                    locked.name)  # fmt: skip
    admin.set_registered_model_alias(locked.name, "by-hand", copy.version)
    workspace = Workspace(home=str(locked.home), tracking=locked.admin)
    expected = (rf"^{locked.name} version {copy.version} \(alias 'by-hand'\) has no passing "
                r"promotion record \(promotion.decision is None")  # fmt: skip
    with pytest.raises(promotion.Unpromoted, match=expected):
        retrain(workspace=workspace, alias="by-hand")
    with pytest.raises(promotion.Unpromoted, match=expected):
        backtest(workspace=workspace, version="by-hand")
    by_number = rf"^{locked.name} version {copy.version} \(asked for by number"
    with pytest.raises(promotion.Unpromoted, match=by_number):
        backtest(workspace=workspace, version=copy.version)


@pytest.mark.slow
@pytest.mark.server
def test_the_promoter_promotes_a_passing_candidate_by_a_copy(locked, candidates):
    """The trained model over a champion made by hand from the untrained one (test_audit:
    at 60 s its edge is clear), as the promoter: the copy, the alias, the record on both."""
    from mlflow.tracking import MlflowClient

    from quantloop.flows.promote import promote
    from quantloop.tasks.runtime.workspace import Workspace

    os.environ.update(MLFLOW_TRACKING_USERNAME=locked.creds.admin.username,
                      MLFLOW_TRACKING_PASSWORD=locked.creds.admin.password)  # fmt: skip
    admin = MlflowClient(locked.uri)
    old = admin.copy_model_version(f"models:/{locked.candidates}/{candidates.worse.model_version}",
                                   locked.name)  # fmt: skip
    admin.set_registered_model_alias(locked.name, "gate-champion", old.version)
    for key in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        os.environ.pop(key)
    workspace = Workspace(home=str(locked.home), tracking=locked.promoter)
    decision = promote(candidates.better.mlflow_run_id, horizon="60s", reproduce_sample=2,
                       workspace=workspace, alias="gate-champion")  # fmt: skip
    assert decision["decision"] == "promoted", decision["gates"]
    assert decision["promoter"] == "promoter" and decision["gates"]["reproduction"]["passed"]
    os.environ.update(MLFLOW_TRACKING_USERNAME=locked.creds.admin.username,
                      MLFLOW_TRACKING_PASSWORD=locked.creds.admin.password)  # fmt: skip
    champion = admin.get_model_version_by_alias(locked.name, "gate-champion")
    assert champion.version == decision["champion_version"] != old.version
    source = f"{locked.candidates}/{candidates.better.model_version}"
    assert champion.tags[promotion.SOURCE] == source and promotion.problems(champion) == []
    assert champion.tags["model_key"] and champion.tags["research_run_id"]  # its recipe
    candidate = admin.get_model_version(locked.candidates, candidates.better.model_version)
    assert candidate.tags[promotion.DECISION] == "promoted"
    assert candidate.tags[promotion.PROMOTER] == "promoter"
    assert candidate.tags[promotion.CHAMPION_VERSION] == f"{locked.name}/{champion.version}"
    assert float(candidate.tags[promotion.TIME_S]) > 0

    # Refused now (the champion's own model): the record says so, no promotion time stays,
    # and the reproduction is not run once the mark-out gate has failed.
    again = promote(candidates.better.mlflow_run_id, horizon="60s", reproduce_sample=2,
                    workspace=Workspace(home=str(locked.home), tracking=locked.admin),
                    alias="gate-champion")  # fmt: skip
    assert again["decision"] == "refused"
    assert again["gates"]["reproduction"] == {
        "nodes": 0, "failures": 0, "passed": None, "skipped": True,
        "why": "not run: the markout gate failed, so the version is refused whatever it "
               "would show"}  # fmt: skip
    tags = admin.get_model_version(locked.candidates, candidates.better.model_version).tags
    assert tags[promotion.DECISION] == "refused" and promotion.TIME_S not in tags
    history = json.loads(tags["promotion.history"])
    assert [h["decision"] for h in history] == ["promoted", "refused"]
    assert history[0]["time_s"] > 0 and "time_s" not in history[1]
    now = admin.get_model_version_by_alias(locked.name, "gate-champion")
    assert now.version == champion.version


@pytest.mark.slow
@pytest.mark.server
def test_rotated_credentials_replace_the_old_ones_on_the_server(tmp_path):
    """identities.rotate, then serve's setup step: the server takes every new password
    (the admin's changed with the old one) and refuses every old one."""
    path = tmp_path / "credentials.json"
    before = identities.load(path)
    with servers.mlflow_server(tmp_path, credentials=(before.admin.username,
                                                      before.admin.password)) as uri:  # fmt: skip
        models = ("rotation", "rotation-candidates")
        identities.setup(uri, before, models=models, experiment="rotation")
        after = identities.rotate(path)
        identities.setup(uri, after, models=models, experiment="rotation")
        search = "/api/2.0/mlflow/experiments/search"
        for role in ("admin", "researcher", "promoter"):
            assert rest(uri, after.mlflow(role), search, {"max_results": 1}) == 200, role
            assert rest(uri, before.mlflow(role), search, {"max_results": 1}) == 401, role
        # a second start with the rotated file finds nothing left to change
        identities.setup(uri, after, models=models, experiment="rotation")
        assert rest(uri, after.admin, search, {"max_results": 1}) == 200
