"""The API server's check of each request's dmi options (vLLM's request validation: a refused
request is answered with HTTP 400 before it runs), and the return folder the response middleware
reads (:mod:`.respond`)."""
from __future__ import annotations

from . import compat, respond
from .config import read_config
from .policy import TOKEN_KEY, RequestRefused, ServePolicy, check, offered_plans, on_request_names, options


def make_validator(vllm_config):
    """The API-server-side check: ``validate(sampling_params)`` raising :class:`RequestRefused`
    (a ValueError: vLLM answers HTTP 400), or None when dmi is not enabled for this engine."""
    from ...spec import load_hook_spec
    cfg = read_config(vllm_config)
    if cfg is None:
        return None
    state: dict = {}

    def names():
        if not state:
            from ...plan import build_plan
            from ...spec import find_arch_spec, load_arch_spec
            hook = load_hook_spec(cfg["hook_spec"])
            hf = vllm_config.model_config.hf_config
            text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
            arch = load_arch_spec(cfg["arch_spec"]) if cfg.get("arch_spec") else find_arch_spec(hf.model_type)
            from ...interventions import plan_interventions
            plan = build_plan(arch, hook, text)
            extra = on_request_names(plan)
            # the interventions' shapes and bounds (their anchors were checked where the model loaded)
            plans = plan_interventions(arch, hook, text, available=None, engine="vllm", anchor_of=lambda c, lay: {})
            state.update(policy=ServePolicy.from_hook(hook), default={s.name for s in plan.sites} - extra, extra=extra,
                         offered=offered_plans(plans))
        return state

    if ServePolicy.from_hook(load_hook_spec(cfg["hook_spec"])).returns:
        respond.bind(compat.return_dir(vllm_config))

    def validate(sampling_params) -> None:
        extra = getattr(sampling_params, "extra_args", None)
        token = (extra or {}).get(TOKEN_KEY)
        if token is not None and not respond.minted(token):
            # (only this process's middleware sets it, for a request it is answering now)
            raise RequestRefused(f"dmi: refused: {TOKEN_KEY} is set by the server only; drop it from the request")
        args = options(extra)
        if args is None:
            return
        s = names()
        check(args, s["policy"], s["default"], s["extra"], s["offered"])
        if args.get("return"):
            if not respond.installed():
                raise RequestRefused("dmi: refused: this server cannot return captures: it runs without dmi's "
                                     "response middleware (operator: start vllm serve with --middleware "
                                     f"{respond.MIDDLEWARE})")
            if token is None:
                raise RequestRefused("dmi: refused: returned captures come in the responses of /v1/completions and "
                                     "/v1/chat/completions only (without stream); ask there")
    return validate
