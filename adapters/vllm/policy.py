"""Per-request capture control, and the operator's limits on it (``vllm serve``).

A request says what it wants in ``SamplingParams.extra_args["dmi"]``::

    {"capture": false}                      # opt out
    {"capture": true}                       # opt in (when the hook spec's requests.default is skip)
    {"sites": ["resid_post", "logits"]}     # only these of the planned sites (globs, as in hook specs)
    {"max_rows": 64}                        # at most this many of its token rows (never above the operator's cap)
    {"interventions": ["steer"]}            # turn on the hook spec's interventions marked requests: on_request
    {"interventions": {"steer": {"scale": 2.0}}}   # ... with values of its own, within the operator's client: bounds
    {"return": ["top_logits", "probes"]}    # small captures back in the response's `dmi` field (requests.return)

Through the OpenAI API (``vllm_xargs`` in the request body, whose values must be flat) the same
options are ``dmi_capture``, ``dmi_sites`` (a list, or one comma-separated string), ``dmi_max_rows``
(``"vllm_xargs": {"dmi_sites": "resid_post,logits"}``), ``dmi_interventions`` (names), ``dmi_<name>.<value>``
(an intervention's own value: ``"dmi_steer.scale": 2.0``; turns it on), ``dmi_return`` (names, or 1 for
everything offered), or ``dmi`` holding the object as a JSON string.

The operator stays in charge through the hook spec's ``requests`` section::

    requests:
      default: capture      # capture | skip: what a request that says nothing gets
      narrow: true          # requests may opt out or pick fewer sites (false: refused)
      max_rows: 4096        # per-request cap on captured token rows (a client cannot slow everyone down)
      return: {top_logits: 5}   # small captures a request may ask back (none unless given; also probes:)

and capture entries marked ``on_request: true``: sites patched into the model but captured only for
requests that name them (widening within what the operator allows; none by default).

Checks happen twice. In the API server process, vLLM's request validation (``validate``, chained
into vLLM's logits-processor parameter check) refuses a request that asks for more than the policy
allows: offline ``LLM.generate`` raises ``ValueError``, ``vllm serve`` answers HTTP 400, the message
names the rule. In the worker, :class:`RequestGate` applies the same rules again (never widening)
and enforces the row caps while the request runs.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from ...interventions import client_values


KEYS = ("capture", "sites", "max_rows", "return", "interventions")
TOKEN_KEY = "dmi_return_token"      # the return channel's token: extra_args key the response middleware sets, never a client


class RequestRefused(ValueError):
    """A request's dmi options ask for more than the operator's hook spec allows."""


@dataclass(frozen=True)
class ServePolicy:
    default: str = "capture"
    narrow: bool = True
    max_rows: int | None = None
    returns: tuple = ()          # ((item, bound), ...): what requests may ask back (requests.return)

    @classmethod
    def from_hook(cls, hook) -> "ServePolicy":
        r = (hook.data if hasattr(hook, "data") else hook).get("requests", {}) or {}
        return cls(default=r.get("default", "capture"), narrow=r.get("narrow", True),
                   max_rows=r.get("max_rows"), returns=tuple(sorted((r.get("return") or {}).items())))

    def describe(self) -> dict:
        offers = dict(self.returns)
        if "probes" in offers:      # (where they read, not their weights)
            offers["probes"] = {n: {k: v for k, v in p.items() if k in ("site", "layer")} for n, p in offers["probes"].items()}
        return {"default": self.default, "narrow": self.narrow, "max_rows": self.max_rows, "return": offers}


@dataclass(frozen=True)
class Want:
    """What one request captures: site indices (None = every default site) and a row cap."""
    sites: frozenset | None
    max_rows: int | None


def on_request_names(plan) -> set[str]:
    """Full names of planned sites whose capture entry says ``on_request: true``."""
    from ...plan import layers_of, match_sites
    from ...spec import Document
    doc = Document(plan.hook_spec, plan.hook_file or "<hook spec>")
    cands = [(s.name, s.canonical, s.layer) for s in plan.sites]
    out: set[str] = set()
    for i, entry in enumerate(plan.hook_spec.get("capture", [])):
        if not entry.get("on_request"):
            continue
        layers = layers_of(entry, plan.layers, doc, ("capture", i))
        for pattern in entry["sites"]:
            out |= {full for full, _, layer in match_sites(pattern, cands)
                    if layer is None or layers is None or layer in layers}
    return out


def options(extra_args) -> dict | None:
    """A request's dmi options from its extra_args: ``dmi`` (an object, or one as a JSON string) and
    flat ``dmi_<option>`` keys (``vllm_xargs``); None when it has none. Values from JSON/HTTP forms
    are normalized (``1``/``"true"`` -> True, ``"a,b"`` -> ["a", "b"])."""
    if not extra_args:
        return None
    raw = extra_args.get("dmi")
    if isinstance(raw, str):
        import json
        try:
            raw = json.loads(raw)
        except ValueError:
            raise RequestRefused("dmi: extra_args['dmi'] is a string but not JSON; pass an object such as "
                                 "{\"capture\": false}") from None
    flat = {k[4:]: v for k, v in extra_args.items() if k.startswith("dmi_") and k != TOKEN_KEY}
    if raw is None and not flat:
        return None
    if raw is not None and not isinstance(raw, dict):
        raise RequestRefused(f"dmi: extra_args['dmi'] must be an object with keys {list(KEYS)}, not "
                             f"{type(raw).__name__}")
    values = {k: flat.pop(k) for k in [k for k in flat if "." in k]}     # dmi_<name>.<value>
    out = {**(raw or {}), **flat}
    if values:
        asked = out.get("interventions")
        if isinstance(asked, str):
            asked = [p.strip() for p in asked.split(",") if p.strip()]
        merged = dict(asked) if isinstance(asked, dict) else {n: {} for n in asked or [] if isinstance(n, str)}
        for key, v in values.items():
            name, value = key.rsplit(".", 1)
            merged[name] = {**(merged.get(name) or {}), value: v}
        out["interventions"] = merged
    for key in ("capture", "return"):
        v = out.get(key)
        if isinstance(v, str) and v.lower() in ("true", "false", "1", "0"):
            out[key] = v.lower() in ("true", "1")
        elif isinstance(v, int) and not isinstance(v, bool) and v in (0, 1):
            out[key] = bool(v)
    if out.get("return") is True:
        out["return"] = ["*"]                     # everything the operator offers
    for key in ("sites", "interventions", "return"):
        if isinstance(out.get(key), str):
            out[key] = [p.strip() for p in out[key].split(",") if p.strip()]
    if isinstance(out.get("max_rows"), str) and out["max_rows"].isdigit():
        out["max_rows"] = int(out["max_rows"])
    return out


def offered_interventions(hook_spec: dict) -> frozenset:
    """Names of the hook spec's interventions a request may turn on (``requests: on_request``)."""
    return frozenset(e["name"] for e in hook_spec.get("interventions") or [] if e.get("requests") == "on_request")


def offered_plans(plans) -> dict:
    """{name: InterventionPlan} of the planned interventions a request may turn on; their
    ``client`` bounds say which values it may set."""
    return {p.name: p for p in plans if p.on_request}


def intervention_values(args) -> dict:
    """{name: the request's own values} of the interventions a checked request turns on ({} each
    when it only names them)."""
    asked = (args or {}).get("interventions") or []
    return dict(asked) if isinstance(asked, dict) else {n: {} for n in asked}


def check(args, policy: ServePolicy, default_names: set[str], extra_names: set[str],
          offered=frozenset()) -> None:
    """Raise :class:`RequestRefused` when a request's ``extra_args["dmi"]`` asks for more than allowed.
    ``offered``: the interventions a request may turn on: names (:func:`offered_interventions`), or
    {name: plan} (:func:`offered_plans`), which also checks the values it sets against the bounds."""
    if args is None:
        return
    if not isinstance(args, dict):
        raise RequestRefused(f"dmi: extra_args['dmi'] must be an object with keys {list(KEYS)}, not "
                             f"{type(args).__name__}")
    unknown = sorted(set(args) - set(KEYS))
    if unknown:
        raise RequestRefused(f"dmi: unknown request option(s) {unknown}; allowed: {list(KEYS)}")
    cap = args.get("capture")
    if cap is not None and not isinstance(cap, bool):
        raise RequestRefused("dmi: 'capture' must be true or false")
    if cap is False and not policy.narrow:
        raise RequestRefused("dmi: refused: this server captures every request; opting out is not allowed "
                             "(operator policy requests.narrow is false)")
    wanted = args.get("return")
    if wanted:
        offers = dict(policy.returns)
        if not offers:
            raise RequestRefused("dmi: refused: captured data is never returned to API clients by this server "
                                 "(operator policy requests.return)")
        if not isinstance(wanted, list) or not all(isinstance(n, str) for n in wanted):
            raise RequestRefused(f"dmi: 'return' must be true or a list of {sorted(offers)}")
        for name in wanted:
            if name != "*" and name not in offers:
                raise RequestRefused(f"dmi: refused: return {name[:80]!r} is not offered by this server; allowed: "
                                     f"{sorted(offers)} (operator policy requests.return)")
    rows = args.get("max_rows")
    if rows is not None:
        if not isinstance(rows, int) or isinstance(rows, bool) or rows < 0:
            raise RequestRefused("dmi: 'max_rows' must be a non-negative integer")
        if policy.max_rows is not None and rows > policy.max_rows:
            raise RequestRefused(f"dmi: refused: max_rows {rows} is above this server's per-request cap "
                                 f"{policy.max_rows} (operator policy requests.max_rows)")
    asked = args.get("interventions")
    if asked is not None:
        if not isinstance(asked, (list, dict)) or not asked or not all(isinstance(n, str) for n in asked):
            raise RequestRefused("dmi: 'interventions' must be a non-empty list of intervention names, or an "
                                 "object {name: {value: number}}")
        for name in asked:
            if name not in offered:
                raise RequestRefused(f"dmi: refused: intervention {name[:80]!r} is not offered on request by this "
                                     f"server (operator hook spec: interventions with requests: on_request)")
        if isinstance(asked, dict):
            for name, values in asked.items():
                if values == {} or values is None:
                    continue
                plan = offered.get(name) if isinstance(offered, dict) else None
                if plan is None or not plan.client:
                    raise RequestRefused(f"dmi: refused: interventions.{name}: this server takes no values of a "
                                         f"request for it (operator hook spec: the intervention's client bounds)")
                client_values(plan, values, _value_error(name))
    sites = args.get("sites")
    if sites is not None:
        if not isinstance(sites, list) or not all(isinstance(s, str) for s in sites) or not sites:
            raise RequestRefused("dmi: 'sites' must be a non-empty list of site names or globs")
        allowed = default_names | extra_names
        for pattern in sites:
            hit = {n for n in allowed if _matches(pattern, n)}
            if not hit:
                # (what the operator captures is not the client's to learn: say what is refused, nothing more)
                raise RequestRefused(
                    f"dmi: refused: site {pattern[:80]!r} is not captured on this server and not offered on request "
                    f"(operator hook spec: capture entries, and entries with on_request: true)")
        if not policy.narrow and not {n for n in default_names if any(_matches(p, n) for p in sites)} >= default_names:
            raise RequestRefused("dmi: refused: this server captures every default site for every request; "
                                 "picking fewer is not allowed (operator policy requests.narrow is false)")


def _value_error(name: str):
    def error(key: str, problem: str) -> RequestRefused:
        return RequestRefused(f"dmi: refused: interventions.{name}{'.' + key if key else ''} {problem}")
    return error


def request_values(args, offered: dict) -> dict:
    """{name: checked values (:func:`dmi.interventions.client_values`)} of the interventions a
    request sets values of (the worker's copy of the check: never wider than the API server's)."""
    out = {}
    for name, values in intervention_values(args).items():
        plan = offered.get(name)
        if values and plan is not None and plan.client:
            out[name] = client_values(plan, values, _value_error(name))
    return out


def _matches(pattern: str, full: str) -> bool:
    canonical = full.split(".", 2)[2] if full.startswith("layers.") else full
    return fnmatch.fnmatchcase(full, pattern) or fnmatch.fnmatchcase(canonical, pattern)


def resolve(args, policy: ServePolicy, plan, extra: set[str]) -> tuple[Want, str | None]:
    """(what the request captures, refusal text or None). Never grants more than ``check`` allows:
    a refused request falls back to the default (or to nothing when the default is skip)."""
    default_idx = frozenset(s.index for s in plan.sites if s.name not in extra)
    all_default = None if not extra else default_idx
    base = Want(all_default if policy.default == "capture" else frozenset(), policy.max_rows)
    if args is None:
        return base, None
    try:
        check(args, policy, {s.name for s in plan.sites if s.name not in extra}, extra,
              offered_plans(getattr(plan, "interventions", ())))
    except RequestRefused as e:
        return base, str(e)
    rows = args.get("max_rows", policy.max_rows)
    if args.get("capture") is False:
        return Want(frozenset(), rows), None
    sites = args.get("sites")
    if sites is not None:
        chosen = frozenset(s.index for s in plan.sites if any(_matches(p, s.name) for p in sites))
        return Want(chosen, rows), None
    if args.get("capture") is True:
        return Want(all_default, rows), None
    return Want(base.sites, rows), None


SHARED_WANTS = 64         # distinct wants the gate shares one object of (the rest, e.g. clients' own row caps, are not)


class RequestGate:
    """Worker side: each request's :class:`Want`, resolved once when it first shows up."""

    def __init__(self, policy: ServePolicy, plan, runner):
        from .compat import request_extra_args
        self.policy, self.plan, self.runner = policy, plan, runner
        self.extra = on_request_names(plan)
        self._read = request_extra_args
        self._wants: dict[str, Want] = {}
        self._shared: dict[Want, Want] = {}
        self.refused: dict[str, str] = {}

    def want(self, req_id: str) -> Want:
        w = self._wants.get(req_id)
        if w is None:
            try:
                args, refusal = options(self._read(self.runner, req_id)), None
            except RequestRefused as e:
                args, refusal = None, str(e)
            w, refused = resolve(args, self.policy, self.plan, self.extra)
            refusal = refusal or refused
            if refusal:
                self.refused[req_id] = refusal
            if w in self._shared or len(self._shared) < SHARED_WANTS:
                w = self._shared.setdefault(w, w)    # one object per distinct want: a batch compares them by identity
            self._wants[req_id] = w
        return w

    def want_all(self, req_ids: list[str]) -> list[Want]:
        """:meth:`want` of each request (a step's batch: the known ones at C speed)."""
        got = list(map(self._wants.get, req_ids))
        if not all(got):                      # (a Want is always true: no Python-level comparisons)
            got = [w if w is not None else self.want(rid) for rid, w in zip(req_ids, got)]
        return got

    def forget(self, finished) -> None:
        for rid in finished:
            self._wants.pop(rid, None)
