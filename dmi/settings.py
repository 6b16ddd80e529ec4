"""Every environment variable dmi reads, declared once: its type, default and what it does.

What a user decides belongs in the hook spec (``policy``, ``store``: docs/settings.md lists both).
The variables here are of three kinds:

* ``serve``: inputs of ``vllm serve``, whose plugin runs in processes vLLM starts, where no Python
  argument reaches it (:mod:`dmi.adapters.vllm.config` reads them);
* ``search``: where architecture specs are found, a path list like ``PATH``;
* ``engine``: switches of the capture engine's internals, each with the default the benchmarks
  chose; set one to compare against that default (perf/) or to work around a machine's limits.

Read them with :func:`get`, never through ``os.environ`` elsewhere.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from .errors import DmiError


@dataclass(frozen=True)
class Setting:
    name: str
    kind: str                  # serve, search or engine (module doc)
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
    Setting("DMI_RING", "engine", None, "the ring backend; unset: cuda on a CUDA device, else cpu (interpret: the "
                                        "CUDA ring's kernels in host memory, TRITON_INTERPRET=1)",
            None),
    Setting("DMI_TRACED", "engine", None, "where compiled code captures as traced ops: 0 (the site op), 1 (every "
                                          "compiled forward) or range (where vLLM's compile pass rewrites the op); "
                                          "unset: range under vLLM's CUDA graphs where no step can outgrow the ring, "
                                          "else 0"),
    Setting("DMI_SIDE", "engine", "full", "capture kernels on a side stream: full (in full CUDA graphs), 1 (in every "
                                          "CUDA graph) or 0 (on the model's stream)", ("0", "1", "full")),
    Setting("DMI_CONSTANT_SITES", "engine", "1", "1: generate()'s compiled forward names its sites as constants; 0: "
                                                 "through their handles", ("0", "1")),
    Setting("DMI_PDL", "engine", "1", "0: no programmatic dependent launch of the capture kernels (Hopper and later)"),
    Setting("DMI_PYDLL", "engine", "1", "0: the CUDA ring's non-blocking calls through cuda-python (which lets the GIL "
                                        "go) instead of libcuda with the GIL held"),
    Setting("DMI_DRAIN_PIECE_MB", "engine", "16", "the drain's device-to-host copies go out in pieces this big, one at "
                                                  "a time (0: each span in one copy)"),
    Setting("DMI_COPY_AT_STEP", "engine", "0", "1: the model's thread queues each step's copy-out when the next step "
                                               "begins"),
    Setting("DMI_STEP_AHEAD", "engine", "1", "0: a compiled generate() begins no decode step ahead of its forward"),
    Setting("DMI_DRAIN_PACED", "engine", "1", "0: the drain runs on its timer only, never in a drain window after a "
                                              "graph replay's launch"),
    Setting("DMI_REPLAY_EAGER", "engine", "1", "0: vLLM's sites outside its graphs (the logits) never replay their "
                                               "launches as CUDA graphs"),
    Setting("DMI_RANGE_COPY", "engine", "1", "0: an eager capture of consecutive rows takes the kernel path, not one "
                                             "strided copy"),
    Setting("DMI_WRITER_PLUGINS", "engine", "", "modules the store writer's child process imports first (comma-"
                                                "separated; zarr codecs or data types of a plugin)"),
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


def on(name: str) -> bool:
    """A switch: on unless ``0`` where it defaults on, off unless ``1`` where it defaults off."""
    value = get(name)
    return value != "0" if SETTINGS[name].default == "1" else value == "1"
