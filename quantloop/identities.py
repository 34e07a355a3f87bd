"""Who may do what on `quantloop serve`'s MLflow: three identities, made on the first start.

- admin (`quantloop`): MLflow's admin. Only serve itself uses it, to create the other
  two users, the registered models and the grants below; nobody's runs record with it.
- researcher (`researcher`): research, retrain and backtest runs, the people browsing
  the UI. MANAGE on the served experiment, EDIT on the candidates model (its runs
  register versions there), READ on the guarded model.
- promoter (`promoter`): only the promote flow and its deployment. MANAGE on the guarded
  model (versions copied in, the `champion` alias), EDIT on the candidates model (the
  decision recorded on the candidate) and on the served experiment (the reproduction
  gate's figures recorded on the research run).

The server's default permission is READ: an authenticated reader (an auditor given the
researcher's credentials) can browse every run and version; what the default cannot give
is a write, and the guarded model's writes are the promoter's alone. (NO_PERMISSIONS
would need a grant per experiment a researcher makes before anyone else could read it.)

The credentials live in <home>/serve/credentials.json (mode 600), one entry each; the
file of the one-user form (`mlflow_user`, `mlflow_password`: that user was the admin) is
upgraded on start, its user kept as the admin. `rotate()` makes new passwords (and a new
Prefect auth string); the next setup changes them on the server, the old admin password
kept in the file until it has.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import secrets
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

ADMIN, RESEARCHER, PROMOTER = "admin", "researcher", "promoter"
# The saved MlflowTracking blocks serve writes: deployments name them in their workspace.
RESEARCHER_BLOCK, PROMOTER_BLOCK = "quantloop-researcher", "quantloop-promoter"


@dataclasses.dataclass(frozen=True)
class Identity:
    username: str
    password: str  # MLflow asks for 12 characters or more

    def __repr__(self) -> str:  # never shown
        return f"Identity({self.username!r}, ...)"

    def basic(self) -> str:
        return "Basic " + base64.b64encode(f"{self.username}:{self.password}".encode()).decode()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Credentials:
    prefect_auth_string: str  # "user:password", Prefect's API auth string
    admin: Identity
    researcher: Identity
    promoter: Identity
    # After rotate(): the admin's password the server still has, until setup changed it.
    previous_admin_password: str | None = None

    def __repr__(self) -> str:  # never shown
        return "Credentials(...)"

    def mlflow(self, role: str) -> Identity:
        return {ADMIN: self.admin, RESEARCHER: self.researcher, PROMOTER: self.promoter}[role]

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "prefect_auth_string": self.prefect_auth_string,
            "mlflow": {
                role: dataclasses.asdict(self.mlflow(role))
                for role in (ADMIN, RESEARCHER, PROMOTER)
            },  # fmt: skip
        }
        if self.previous_admin_password:
            out["mlflow"]["admin"]["previous_password"] = self.previous_admin_password
        return out

    @classmethod
    def from_json(cls, values: dict[str, Any]) -> Credentials:
        m = values["mlflow"]
        return cls(
            prefect_auth_string=values["prefect_auth_string"],
            admin=Identity(m[ADMIN]["username"], m[ADMIN]["password"]),
            researcher=Identity(m[RESEARCHER]["username"], m[RESEARCHER]["password"]),
            promoter=Identity(m[PROMOTER]["username"], m[PROMOTER]["password"]),
            previous_admin_password=m[ADMIN].get("previous_password"),
        )


def _secret() -> str:
    return secrets.token_urlsafe(18)


def new(admin: Identity | None = None, prefect_auth_string: str | None = None) -> Credentials:
    return Credentials(
        prefect_auth_string=prefect_auth_string or f"quantloop:{_secret()}",
        admin=admin or Identity("quantloop", _secret()),
        researcher=Identity(RESEARCHER, _secret()),
        promoter=Identity(PROMOTER, _secret()),
    )


def write(path: str | os.PathLike, creds: Credentials) -> None:
    """Atomically, readable by its owner only (made 600 before anything is written)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(creds.as_json(), f, indent=1)
    os.replace(tmp, path)


def load(path: str | os.PathLike) -> Credentials:
    """The credentials in `path`, made on the first call; a file of the one-user form
    is upgraded in place (its MLflow user, the server's admin, stays the admin)."""
    path = Path(path)
    if not path.exists():
        made = new()
        write(path, made)
        return made
    values = json.loads(path.read_text())
    if "mlflow" not in values:  # the one-user form
        upgraded = new(Identity(values["mlflow_user"], values["mlflow_password"]),
                       values["prefect_auth_string"])  # fmt: skip
        write(path, upgraded)
        return upgraded
    if path.stat().st_mode & 0o077:
        os.chmod(path, 0o600)
    return Credentials.from_json(values)


def rotate(path: str | os.PathLike) -> Credentials:
    """New passwords for every identity and a new Prefect auth string, written now; the
    server's admin password is kept as previous until setup() has changed it there."""
    old = load(path)
    rotated = dataclasses.replace(
        new(Identity(old.admin.username, _secret())),
        previous_admin_password=old.previous_admin_password or old.admin.password,
    )
    write(path, rotated)
    return rotated


def read_for(home: str | os.PathLike, role: str) -> Identity | None:
    """The identity `role` of the stack served from `home`, if serve made one there."""
    path = Path(home) / "serve" / "credentials.json"
    try:
        values = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if "mlflow" not in values:  # the one-user form: its user is all there is
        return Identity(values["mlflow_user"], values["mlflow_password"])
    entry = values["mlflow"].get(role)
    return Identity(entry["username"], entry["password"]) if entry else None


class AuthError(RuntimeError):
    pass


def _call(url: str, who: Identity, path: str, body: dict | None = None,
          method: str | None = None) -> tuple[int, dict]:  # fmt: skip
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url.rstrip("/") + path, data=data,
                                     method=method or ("POST" if data else "GET"))  # fmt: skip
    request.add_header("Content-Type", "application/json")
    request.add_header("Authorization", who.basic())
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            text = r.read()
            return r.status, json.loads(text) if text.strip() else {}
    except urllib.error.HTTPError as exc:
        text = exc.read()
        try:
            return exc.code, json.loads(text)
        except ValueError:
            return exc.code, {"message": text.decode(errors="replace")[:200]}


def _ok(what: str, status: int, answer: dict, *also: str) -> None:
    if status != 200 and answer.get("error_code") not in also:
        raise AuthError(f"MLflow setup: {what}: HTTP {status} {answer.get('message', '')}")


def setup(url: str, creds: Credentials, *, models: tuple[str, str], experiment: str) -> str:
    """On a basic-auth MLflow server at `url`: the admin's password as in `creds` (changed
    from the previous one after a rotation), the researcher and promoter users with their
    passwords, the guarded and candidates models and the served experiment, and the
    grants of the module's docstring; returns the experiment's id. Idempotent: each start
    runs it."""
    admin = creds.admin
    status, answer = _call(url, admin, f"/api/2.0/mlflow/users/get?username={admin.username}")
    if status == 401 and creds.previous_admin_password:
        before = Identity(admin.username, creds.previous_admin_password)
        # MLflow asks for the current password when a user changes its own
        status, answer = _call(url, before, "/api/2.0/mlflow/users/update-password",
                               {"username": admin.username, "password": admin.password,
                                "current_password": before.password}, "PATCH")  # fmt: skip
        _ok("the admin's new password", status, answer)
    elif status == 401:
        raise AuthError(
            f"MLflow setup: the server refuses admin {admin.username!r}'s password from "
            "credentials.json (its auth database, serve/mlflow-auth.db, has another)"
        )
    for who in (creds.researcher, creds.promoter):
        status, answer = _call(url, admin, "/api/2.0/mlflow/users/create",
                               {"username": who.username, "password": who.password})  # fmt: skip
        if answer.get("error_code") == "RESOURCE_ALREADY_EXISTS":
            status, answer = _call(url, admin, "/api/2.0/mlflow/users/update-password",
                                   {"username": who.username, "password": who.password},
                                   "PATCH")  # fmt: skip
        _ok(f"user {who.username}", status, answer)
    guarded, candidates = models
    for name in models:
        status, answer = _call(url, admin, "/api/2.0/mlflow/registered-models/create",
                               {"name": name})  # fmt: skip
        _ok(f"registered model {name}", status, answer, "RESOURCE_ALREADY_EXISTS")
    status, answer = _call(url, admin, "/api/2.0/mlflow/experiments/get-by-name"
                           f"?experiment_name={urllib.parse.quote(experiment)}")  # fmt: skip
    if status == 200:
        experiment_id = answer["experiment"]["experiment_id"]
    else:
        status, answer = _call(url, admin, "/api/2.0/mlflow/experiments/create",
                               {"name": experiment})  # fmt: skip
        _ok(f"experiment {experiment}", status, answer)
        experiment_id = answer["experiment_id"]
    grants = [
        (creds.researcher, "experiment", experiment_id, "MANAGE"),
        (creds.researcher, "registered_model", candidates, "EDIT"),
        (creds.researcher, "registered_model", guarded, "READ"),
        (creds.promoter, "experiment", experiment_id, "EDIT"),
        (creds.promoter, "registered_model", candidates, "EDIT"),
        (creds.promoter, "registered_model", guarded, "MANAGE"),
    ]
    for who, kind, resource, permission in grants:
        which = {"username": who.username, "resource_type": kind, "resource_id": resource}
        status, answer = _call(url, admin, "/api/3.0/mlflow/users/permissions/grant",
                               {**which, "permission": permission})  # fmt: skip
        if status == 400 and "already exists" in str(answer.get("message")):
            # a later start: granted again as it should be, whatever it was changed to
            status, answer = _call(url, admin, "/api/3.0/mlflow/users/permissions/revoke", which)
            _ok(f"revoking {kind} {resource} for {who.username}", status, answer)
            status, answer = _call(url, admin, "/api/3.0/mlflow/users/permissions/grant",
                                   {**which, "permission": permission})  # fmt: skip
        _ok(f"{permission} on {kind} {resource} for {who.username}", status, answer)
    return experiment_id
