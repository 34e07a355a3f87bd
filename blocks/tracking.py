"""MLflow tracking settings: where runs, metrics and artifacts go."""

from __future__ import annotations

import os

from prefect.blocks.core import Block
from pydantic import Field, SecretStr

# MLflow 3.17's UI shows an experiment in its GenAI view (traces, evaluations, a popover
# over the page) or its model-training view, chosen by this query parameter of the page's
# address, else by the browser's last choice, GenAI in a browser that never chose; it
# does not read the experiment's `mlflow.experimentKind` tag. Links we write carry it.
MODEL_TRAINING_VIEW = "workflowType=machine_learning"


class MlflowTracking(Block):
    """Where quantloop records runs: an MLflow tracking server or a local SQLite store.

    Example:
        ```python
        from quantloop.blocks.tracking import MlflowTracking
        tracking = MlflowTracking.load("desk-mlflow")
        print(tracking.tracking_uri, tracking.experiment)
        ```
    """

    _block_type_name = "quantloop MLflow Tracking"
    _block_type_slug = "quantloop-mlflow-tracking"
    _description = "MLflow tracking URI, experiment and artifact location for quantloop runs."

    tracking_uri: str = Field(
        default="sqlite:///.quantloop/mlflow.db",
        description="MLflow tracking URI: http://host:5000 for a server, sqlite:///path for local.",
    )
    experiment: str = Field(default="quantloop", description="MLflow experiment name.")
    registered_model: str = Field(
        default="quantloop-orderbook",
        description="The guarded registered model (MLflow Model Registry) whose `champion` "
        "alias retrain, backtest and `models:/<name>@champion` use: only the promote flow "
        "adds versions to it (copies of candidates that passed its gates).",
    )
    candidate_model: str | None = Field(
        default=None,
        description="Registered model that research and retrain runs register their "
        "models in, as candidates for promotion. Empty: the guarded model's name plus "
        "'-candidates' (quantloop-orderbook-candidates).",
    )
    artifact_location: str | None = Field(
        default=None,
        description="Where a new experiment stores artifacts (local store only; a server "
        "decides its own). Default: beside the SQLite file.",
    )

    ui_url: str | None = Field(
        default=None,
        description="Where people open these runs in a browser (an MLflow server or `mlflow "
        "ui` over this store, http://host:5000); run summaries link there. Empty: the "
        "tracking URI when it is http(s).",
    )

    username: str | None = Field(
        default=None,
        description="User for a tracking server started with MLflow's basic auth "
        "(`mlflow server --app-name basic-auth`). Empty: MLFLOW_TRACKING_USERNAME, if set.",
    )
    password: SecretStr | None = Field(
        default=None,
        description="That user's password (kept secret: never shown or logged). Empty: "
        "MLFLOW_TRACKING_PASSWORD, if set.",
    )

    @property
    def candidates(self) -> str:
        """The registered model trained models become versions of (candidate_model)."""
        return self.candidate_model or f"{self.registered_model}-candidates"

    def resolved_uri(self) -> str:
        """The URI with a relative SQLite path made absolute (runs may change directory)."""
        prefix = "sqlite:///"
        if self.tracking_uri.startswith(prefix) and not self.tracking_uri.startswith(prefix + "/"):
            return prefix + os.path.abspath(self.tracking_uri[len(prefix) :])
        return self.tracking_uri

    def ui_base(self) -> str | None:
        """The MLflow UI's address, or None when no UI is known for this store."""
        base = self.ui_url or (
            self.tracking_uri if self.tracking_uri.startswith(("http://", "https://")) else None
        )
        return base.rstrip("/") if base else None

    def experiment_url(self, experiment_id: str) -> str | None:
        """An experiment's runs in the MLflow UI's model-training view, or None when no UI
        is known for this store."""
        base = self.ui_base()
        if base is None:
            return None
        return f"{base}/#/experiments/{experiment_id}/runs?{MODEL_TRAINING_VIEW}"

    def run_url(self, experiment_id: str, run_id: str) -> str | None:
        """A run's page in the MLflow UI, or None when no UI is known for this store."""
        base = self.ui_base()
        if base is None:
            return None
        return f"{base}/#/experiments/{experiment_id}/runs/{run_id}?{MODEL_TRAINING_VIEW}"

    def resolved_artifact_location(self) -> str | None:
        if self.artifact_location:
            return self.artifact_location
        uri = self.resolved_uri()
        if uri.startswith("sqlite:///"):
            return os.path.join(os.path.dirname(uri[len("sqlite:///") :]), "mlartifacts")
        return None
