"""What libraries build on their first call in a process, built once in the warm process
(quantloop/forkserver.py WARM_CALLS) so that the commands forked from it do not each build
it again. Found by py-spy over a warm child's cached re-run (2026-12-05, this 2-core VM,
the H200's research shape): Prefect's client models completed on first use (pydantic
leaves a model with forward references "mocked" until then: FlowRunFilter 23 ms in a
subflow's start) and sqlparse's lexer (MLflow's search filter: 37 ms under the
profiler). Imports a run makes late are in forkserver.WARM_MODULES instead."""

from __future__ import annotations

import importlib

# Prefect's client schemas (the engine's API calls) and its artifacts (the run's summary)
PREFECT_MODEL_MODULES = (
    "prefect.client.schemas.filters",
    "prefect.client.schemas.objects",
    "prefect.client.schemas.actions",
    "prefect.client.schemas.responses",
    "prefect.client.schemas.sorting",
    "prefect.artifacts",
)


def warm() -> None:
    prefect_models()
    sqlparse_lexer()


def prefect_models() -> int:
    """Complete every pydantic model of PREFECT_MODEL_MODULES that is not (~180, 45 ms
    here); the number completed."""
    import pydantic

    done = 0
    for name in PREFECT_MODEL_MODULES:
        module = importlib.import_module(name)
        for value in list(vars(module).values()):
            if (isinstance(value, type) and issubclass(value, pydantic.BaseModel)
                    and value.__module__ == name and not value.__pydantic_complete__):  # fmt: skip
                value.model_rebuild()
                done += 1
    return done


def sqlparse_lexer() -> None:
    """sqlparse's default lexer: its ~200 regular expressions compiled (MLflow parses a
    search filter with it)."""
    from sqlparse.lexer import Lexer

    Lexer.get_default_instance()
