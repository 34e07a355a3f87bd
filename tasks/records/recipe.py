"""A registered model version's recipe: what it was trained with, read back from MLflow.

A version names its training run's parent (tag `research_run_id`: a research run, or a
retrain run), whose `params/resolved_params.json` holds the form as run and the data
selection; the version's own `train_config` tag is the training config exactly as the
model was trained. Retraining takes this recipe to newer data; a backtest takes its
feature parameters, so the model reads the features it was trained on.

The version is the model of a run's last walk-forward fold (trained on its most recent
data); the recipe's `validation` is the folds the run made, and the version's
`fold_window` tag the window of its own fold. A run from before the folds, whose form
has a top-level `holdout_fraction`, made the single split: its validation reads as that
(tasks/research/form.holdout_into_validation).
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from quantloop.tasks.records.runs import read_artifact

if TYPE_CHECKING:  # this module imports no MLflow: the client its caller made does
    from mlflow.entities.model_registry import ModelVersion
    from mlflow.tracking import MlflowClient

    from quantloop.tasks.data.catalog import Catalog

RESOLVED_PARAMS = "params/resolved_params.json"  # what a research (or retrain) run logs
_NUMBER = re.compile(r"^[0-9]+$")


def resolve_version(client: MlflowClient, name: str, ref: str) -> ModelVersion:
    """Version `ref` of registered model `name`: a number ("3") or an alias ("champion").

    LookupError naming the model, the reference, the tracking server and what exists
    (versions and aliases) when there is no such model or version: never a default."""
    where = client.tracking_uri
    try:
        registered = client.get_registered_model(name)
    except Exception as exc:  # MLflow's RESOURCE_DOES_NOT_EXIST, or the server's refusal
        raise LookupError(f"no registered model {name!r} at {where}") from exc
    aliases = dict(getattr(registered, "aliases", None) or {})
    try:
        if _NUMBER.match(ref):
            return client.get_model_version(name, ref)
        return client.get_model_version_by_alias(name, ref)
    except Exception as exc:
        versions = sorted(
            (int(v.version) for v in client.search_model_versions(f"name = '{name}'")),
        )
        known = (
            f"versions {versions[0]}..{versions[-1]}" if versions else "no versions"
        ) + (", aliases " + ", ".join(f"{a} -> {v}" for a, v in sorted(aliases.items()))
             if aliases else ", no aliases")  # fmt: skip
        what = "version" if _NUMBER.match(ref) else "alias"
        raise LookupError(
            f"registered model {name!r} has no {what} {ref!r} at {where} ({known})"
        ) from exc


@dataclass(frozen=True, slots=True)
class Recipe:
    """How a model version was made, as plain JSON values (the forms validate them)."""

    model: str
    version: str
    model_key: str
    model_digest: str
    source_run_id: str  # the research (or retrain) run that trained it
    train: dict[str, Any]  # TrainConfig, as trained (the version's train_config tag)
    features: dict[str, Any]  # FeatureParams
    product_features: dict[str, dict]
    validation: dict[str, Any]  # WalkForward: the folds its run trained one model for each
    simulation: dict[str, Any]  # SimConfig
    dataset: str
    products: list[str]
    dates: int  # how many trading days it was trained and held out on

    def digest_fields(self) -> dict[str, Any]:
        """What makes the recipe, without which model it belongs to: two versions with
        equal digest_fields were made the same way (on maybe other data)."""
        fields = ("train", "features", "product_features", "validation", "simulation",
                  "dataset", "products", "dates")  # fmt: skip
        return {f: getattr(self, f) for f in fields}


def read_recipe(
    client: MlflowClient, version: ModelVersion, catalog: Catalog | None = None
) -> Recipe:
    """The recipe of a registered version; LookupError naming what is missing.

    catalog: where the run's pinned selection is, to count the days it covered (a
    research run on LOBSTER files names no day count)."""
    label = f"{version.name} version {version.version}"
    tags = version.tags or {}
    missing = [t for t in ("research_run_id", "train_config", "model_key", "model_digest")
               if not tags.get(t)]  # fmt: skip
    if missing:
        raise LookupError(f"{label} has no recipe: tags {missing} are missing (not made by "
                          "quantloop's train stage?)")  # fmt: skip
    run_id = tags["research_run_id"]
    try:
        resolved = json.loads(read_artifact(client, run_id, RESOLVED_PARAMS))
    except Exception as exc:
        raise LookupError(
            f"{label}: its run {run_id} has no readable {RESOLVED_PARAMS} at "
            f"{client.tracking_uri}: {exc}"
        ) from exc
    params, selection = resolved["params"], resolved["selection"]
    dates = resolved.get("dates")  # a retrain run records it
    if not dates and catalog is not None and selection.get("pin"):
        with contextlib.suppress(LookupError):  # the pin is in another catalog
            dates = len(set(catalog.pinned(selection["pin"])["date"].to_pylist()))
    if not dates:  # a synthetic research run's day count is its form's
        dates = params.get("data", {}).get("n_dates") or 1
    return Recipe(
        model=version.name,
        version=str(version.version),
        model_key=tags["model_key"],
        model_digest=tags["model_digest"],
        source_run_id=run_id,
        train=json.loads(tags["train_config"]),
        features=params["features"],
        product_features=params.get("product_features") or {},
        validation=validation_of(params),
        simulation=params["simulation"],
        dataset=selection["dataset"],
        products=list(selection.get("products") or []),
        dates=int(dates),
    )


def validation_of(params: dict[str, Any]) -> dict[str, Any]:
    """A run's validation (every WalkForward field) from its resolved form; a form from
    before the folds gives the single split its holdout_fraction made."""
    from pydantic import TypeAdapter

    from quantloop.tasks.research.form import ValidationForm, holdout_into_validation

    given = holdout_into_validation(params).get("validation")
    adapter = TypeAdapter(ValidationForm)
    return asdict(adapter.validate_python({} if given is None else given))
