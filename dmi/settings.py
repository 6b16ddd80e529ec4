"""Every setting dmi reads, declared once.

What a user decides belongs in the hook spec: its ``policy``, ``store`` and ``engine`` sections
(docs/settings.md lists every key). The ``engine`` section reaches the engine code as one
:class:`EngineOptions` (``plan.engine``), never through globals.

The few environment variables left are of two kinds:

* ``serve``: inputs of ``vllm serve``, whose plugin runs in processes vLLM starts, where no Python
  argument reaches it (:mod:`dmi.adapters.vllm.config` reads them);
* ``search``: where architecture specs are found, a path list like ``PATH``.

Read them with :func:`get`, never through ``os.environ`` elsewhere.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

from .errors import DmiError


@dataclass(frozen=True)
class Setting:
    name: str
    kind: str                  # serve or search (module doc)
    default: str | None        # as the environment would give it; None: unset
    doc: str
    choices: tuple[str, ...] | None = None     # the values it takes (None: any, or checked where it is used)


SETTINGS = {s.name: s for s in (
    Setting("DMI_HOOK_SPEC", "serve", None, "the hook spec's path; set, it enables dmi in every engine vllm serve starts"),
    Setting("DMI_STORE", "serve", None, "the store's path (else additional_config.dmi.store, else the hook spec's "
                                        "store.path)"),
    Setting("DMI_OVERWRITE", "serve", "0", "1, true or yes: replace an existing store"),
    Setting("DMI_ARCH_SPEC", "serve", None, "the architecture spec's path (else found by the model's type)"),
    Setting("DMI_SHUTDOWN_GRACE_S", "serve", "30", "seconds vLLM's engine shutdown waits for dmi to close the store"),
    Setting("DMI_SPEC_PATH", "search", None, "directories searched for architecture specs before the built-in ones "
                                             "(os.pathsep-separated)"),
)}


def get(name: str) -> str | None:
    """The setting's value: the environment's (an empty value counts as unset), else its default;
    refused with the fix when it is not one of its choices."""
    setting = SETTINGS[name]
    value = os.environ.get(name) or setting.default
    if setting.choices is not None and value is not None and value not in setting.choices:
        others = "".join(f", {c}" for c in setting.choices if c != setting.default)
        raise DmiError(f"{name}={value!r}: unknown. Fix: {setting.default} (the default){others}; {setting.doc}")
    return value


# --- the hook spec's engine section ----------------------------------------------------------------

# the hook spec's words for traced and side -> the values the engine code compares against
TRACED = {"off": "0", "all": "1", "range": "range"}
SIDE = {"full": "full", "all": "1", "off": "0"}


@dataclass(frozen=True)
class EngineOptions:
    """The hook spec's ``engine`` section: how the capture engine does its work (never what is
    captured). Each default is the one the benchmarks chose (perf/); schemas/hook_spec.schema.json
    says what each key does."""
    ring: str | None = None            # cpu | cuda | interpret; None: cuda on a CUDA device, else cpu
    traced: str | None = None          # "0" | "1" | "range" (TRACED's values); None: the engine's choice
    side: str = "full"                 # "full" | "1" | "0" (SIDE's values)
    constant_sites: bool = True        # generate()'s compiled forward names its sites as constants
    pdl: bool = True                   # programmatic dependent launch of the capture kernels (Hopper on)
    copy_at_step: bool = False         # the model's thread queues each step's copy-out as the next begins
    step_ahead: bool = True            # a compiled generate() begins the next decode step during this one
    writer_plugins: tuple[str, ...] = ()   # module:function called first in the store writer's process

    @classmethod
    def from_spec(cls, section: dict | None) -> "EngineOptions":
        """The options of a hook spec's (schema-validated) ``engine`` section."""
        s = dict(section or {})
        warn_engine_env()
        return cls(ring=s.get("ring"), traced=TRACED[s["traced"]] if "traced" in s else None,
                   side=SIDE[s.get("side", "full")], constant_sites=s.get("constant_sites", True),
                   pdl=s.get("pdl", True), copy_at_step=s.get("copy_at_step", False),
                   step_ahead=s.get("step_ahead", True), writer_plugins=tuple(s.get("writer_plugins", ())))


# environment variables dmi no longer reads -> what took their place
_REPLACED = {
    "DMI_RING": "the hook spec's engine.ring (cpu, cuda or interpret)",
    "DMI_TRACED": "the hook spec's engine.traced (off for 0, all for 1, or range)",
    "DMI_SIDE": "the hook spec's engine.side (full, all for 1, or off for 0)",
    "DMI_CONSTANT_SITES": "the hook spec's engine.constant_sites (true or false)",
    "DMI_PDL": "the hook spec's engine.pdl (true or false)",
    "DMI_COPY_AT_STEP": "the hook spec's engine.copy_at_step (true or false)",
    "DMI_STEP_AHEAD": "the hook spec's engine.step_ahead (true or false)",
    "DMI_WRITER_PLUGINS": "the hook spec's engine.writer_plugins (a list of module:function)",
    "DMI_PYDLL": "nothing: the CUDA ring checks its libcuda calls at start and falls back to cuda-python by itself",
    "DMI_DRAIN_PIECE_MB": "nothing: the drain always copies in 16 MiB pieces, one at a time",
    "DMI_DRAIN_PACED": "nothing: the drain always opens a window after a graph replay's launch",
    "DMI_REPLAY_EAGER": "nothing: vLLM's sites outside its graphs always replay their launches as CUDA graphs",
    "DMI_RANGE_COPY": "nothing: an eager capture of consecutive rows is always one strided copy",
}
_warned: set[str] = set()


def warn_engine_env() -> None:
    """Warn, once per variable and process, about an environment variable that used to switch the
    engine: it is ignored now, and the warning names what took its place."""
    for name, instead in _REPLACED.items():
        if os.environ.get(name) and name not in _warned:
            _warned.add(name)
            warnings.warn(f"dmi: {name} is set but no longer read. Fix: unset it; its place: {instead} "
                          f"(docs/settings.md)", FutureWarning, stacklevel=3)
