"""One assembly of a capture run, for every engine.

An engine adapter (:class:`EngineAdapter`: ``dmi.adapters.hf.engine``, ``dmi.adapters.vllm.engine``)
says what only it knows: which model it captures, whether the architecture spec was written for
its version, which sites exist in the loaded model, and how to patch them in. The rest is the same
for every engine, in this order: the architecture spec (:func:`find_arch`), the plan
(:func:`plan_run`), then the run and its patches (:func:`build_run`).
"""
from __future__ import annotations

from typing import Any, Callable, Protocol

from .interventions import plan_interventions
from .plan import Plan, build_plan
from .run import Run
from .store.location import remove_store
from .spec import Document, check_arch_matches, find_arch_spec, load_arch_spec


class EngineAdapter(Protocol):
    """What an engine adapter gives the pipeline."""

    name: str                     # the plan's engine: "hf" or "vllm"

    def resolve_model(self, model: Any, **kwargs) -> Any:
        """The engine's model from what the user (or the engine) gave."""

    def check_version(self, arch: Document) -> None:
        """Warn, or refuse with the fix, where ``arch`` was not written for this engine's version."""

    def available_sites(self, model: Any, arch: Document, config: Any) -> tuple[set, dict]:
        """(canonical, layer) pairs whose anchors resolve in ``model``, and the canonical sites this
        engine never computes, with why."""

    def attach(self, model: Any, plan: Plan, arch: Document, run: Run) -> Callable[[], None]:
        """Patch the plan's sites into ``model`` for ``run``; returns what undoes it."""

    def write_anchor(self, arch: Document, canonical: str, layer: int | None, n_layers: int) -> dict | None:
        """The anchor where this engine patches ``canonical`` of ``layer`` (interventions write there)."""


def find_arch(arch_spec, model_type: str | None, also: str | None = None) -> Document:
    """The architecture spec: ``arch_spec`` (a path or a dict) or the one found by ``model_type``,
    refused unless it matches ``model_type`` (or ``also``: a multimodal model's text model type)."""
    arch = load_arch_spec(arch_spec) if arch_spec is not None else find_arch_spec(model_type)
    if also is None or also not in arch.data["match"]["model_type"]:
        check_arch_matches(arch, model_type)
    return arch


def plan_run(adapter: EngineAdapter, model: Any, arch: Document, hook: Document, config: Any, itemsize: int) -> Plan:
    """The plan of ``hook`` for ``model`` (``config``: its text model's config), checked against
    the sites the adapter finds in the loaded model."""
    adapter.check_version(arch)
    available, unavailable = adapter.available_sites(model, arch, config)
    plan = build_plan(arch, hook, config, model_dtype_itemsize=itemsize, available=available,
                      unavailable=unavailable or None, engine=adapter.name)
    plan.interventions = plan_interventions(
        arch, hook, config, available=available, engine=adapter.name,
        anchor_of=lambda canonical, layer: adapter.write_anchor(arch, canonical, layer, plan.layers))
    return plan


def build_run(adapter: EngineAdapter, model: Any, plan: Plan, arch: Document, store, *,
              checks: tuple = (), keep_store: bool = False, **run_kwargs) -> Run:
    """Start a run of ``plan`` into ``store`` and patch ``model`` for it. ``checks``: functions of
    the run that refuse what it cannot capture (before any patch). On any failure the run is
    closed and, unless ``keep_store`` (a resumed store, another rank's), its store removed: nothing
    was captured."""
    run = Run(model, plan, str(store), **run_kwargs)
    try:
        for check in checks:
            check(run)
        run.on_close(adapter.attach(model, plan, arch, run))
    except BaseException:
        run.close()
        if not keep_store:
            remove_store(run.store, plan.storage_options)
        raise
    return run
