"""A version's promotion record (what flows/promote.py writes) and the check its
consumers make: retrain, backtest and anything that loads the guarded model's champion
use a version only with a passing record.

Under `quantloop serve` (and infra/'s identities) only the promoter may write the guarded
registered model, so its versions' records are the promote flow's. On an embedded SQLite
store there are no identities: whoever can write the file can write a tag, and the check
only stops a version that nobody promoted (an alias moved by hand, say).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlflow.entities.model_registry import ModelVersion

DECISION = "promotion.decision"
GATES = "promotion.gates"
PROMOTER = "promotion.promoter"  # the MLflow identity that promoted it
SOURCE = "promotion.source"  # on a copy in the guarded model: "<candidates>/<version>"
CHAMPION_VERSION = "promotion.champion_version"  # on the candidate: the copy's number
DECIDED_AT = "promotion.decided_at"
TIME_S = "promotion.time_s"  # only while the latest decision is "promoted"
GATE_NAMES = ("markout", "reproduction", "ladder")


class Unpromoted(LookupError):
    """A champion (or a version of the guarded model) without a passing promotion record."""


def problems(version: ModelVersion) -> list[str]:
    """What the version's record lacks to show a promotion (empty: it shows one)."""
    tags = dict(version.tags or {})
    found = []
    if tags.get(DECISION) != "promoted":
        found.append(f"{DECISION} is {tags.get(DECISION)!r}, not 'promoted'")
    try:
        gates = json.loads(tags.get(GATES) or "null")
    except ValueError:
        gates = None
    if not isinstance(gates, dict):
        found.append(f"no {GATES}")
    else:
        failed = [g for g in GATE_NAMES if (gates.get(g) or {}).get("passed") is not True]
        if failed:
            found.append(f"gates not passed: {', '.join(failed)}")
        elif (gates["markout"].get("p_adjusted")) is None:
            found.append("the mark-out gate records no p-value")
    for tag in (PROMOTER, SOURCE):
        if not tags.get(tag):
            found.append(f"no {tag}")
    return found


def require_promoted(version: ModelVersion, how: str) -> None:
    """Unpromoted, one line naming the model and version, unless the record passes.
    `how`: how the version was asked for (an alias, a number)."""
    missing = problems(version)
    if missing:
        raise Unpromoted(
            f"{version.name} version {version.version} ({how}) has no passing promotion "
            f"record ({'; '.join(missing)}): refused. Only `quantloop promote <run>` makes "
            "a champion; to use an unpromoted model, name its candidate version instead."
        )


def resolve_for_use(client, name: str, ref: str, *, guarded: str,
                    alias: str = "champion") -> ModelVersion:  # fmt: skip
    """Version `ref` (a number or an alias) of registered model `name`, as retrain and
    backtest use it: a version of the guarded model, or one reached through `alias`,
    only with a passing promotion record (Unpromoted otherwise); a candidate named by
    its number in another model as it is."""
    from quantloop.tasks.records.recipe import resolve_version

    version = resolve_version(client, name, ref)
    if name == guarded or ref == alias:
        how = f"alias {ref!r}" if not ref.isdigit() else f"asked for by number in {name!r}"
        require_promoted(version, how)
    return version
