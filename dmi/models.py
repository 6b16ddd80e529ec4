"""Built-in tiny models: random-init configs of each family and a small local BPE tokenizer.

No model hub is needed: these are what the tests, the README's first command and the CPU CI use.
Real models go through ``dmi.load("org/name")`` (``from_pretrained``) unchanged.
"""
from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache

_CORPUS = """The quick brown fox jumps over the lazy dog. A model's internals are a window into how it
computes: residual streams carry features from layer to layer, attention heads move information
between positions, and MLPs write new features. Observability means seeing these while serving.
Interpretability researchers probe layers, safety teams monitor activations, and serving engineers
watch the cost. Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000. Hello world! How are you today? What is
the capital of France? Paris is the capital of France. Tell me a story about a dragon and a knight.
Once upon a time there was a small robot who wanted to learn how to paint the sea at night."""

TINY_VOCAB = 512
TINY_TOKENIZER_VOCAB = 320


# Sizes of the named dims (docs/sites.md) in a tiny model; a spec's `tiny:` block gives the others
TINY_SIZES = {"layer": 3, "hidden": 64, "head": 4, "kv_head": 2, "head_dim": 32, "mlp": 128, "vocab": TINY_VOCAB,
              "expert": 4, "k": 2}
TINY_COMMON = dict(max_position_embeddings=1024, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
                   eos_token_id=2)


@lru_cache(maxsize=1)
def builtin_families() -> dict[str, str]:
    """family -> file of every built-in architecture spec (``dmi/specs/*.yaml``)."""
    from .spec import list_specs, load_arch_spec
    return {load_arch_spec(p).data["family"]: str(p) for p in list_specs()}


def tiny_config(family):
    """A small random-init config of an architecture family: ``family`` names a built-in spec, or is
    an architecture spec (a :class:`dmi.spec.Document`). Built from the spec alone: the config class
    of its first ``match.model_type`` (transformers' ``AutoConfig``), each named dim of ``dims`` at
    its tiny size (``TINY_SIZES``), then the spec's ``tiny:`` block (config attribute -> value)
    for what the family needs besides (expert counts, MLA ranks, rope parameters)."""
    import transformers as tf
    from .spec import Document, load_arch_spec
    if isinstance(family, Document):
        arch = family
    else:
        if family not in builtin_families():
            raise KeyError(family)
        arch = load_arch_spec(builtin_families()[family])
    d = arch.data
    tiny = d.get("tiny", {})
    values = dict(TINY_COMMON)
    for dim, attr in d["dims"].items():
        if dim in TINY_SIZES and attr not in tiny:
            values[attr] = TINY_SIZES[dim]      # (other dims: the tiny block's value, or the config class's)
    values.update(tiny)
    model_type = d["match"]["model_type"][0]
    try:
        config = tf.AutoConfig.for_model(model_type, **values)
    except (ValueError, TypeError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise arch.error(("tiny",) if "tiny" in d else ("match", "model_type"),
                         f"cannot build a tiny config of model_type {model_type!r} with transformers "
                         f"{tf.__version__}: {first}",
                         fix="list a model_type this transformers knows first under match.model_type, and give "
                             "under `tiny:` the config values its class needs") from None
    for dim, attr in d["dims"].items():
        if dim != "head_dim" and not isinstance(getattr(config, attr, None), int):   # (head_dim may be derived)
            raise arch.error(("dims", dim), f"the tiny {type(config).__name__} has no integer attribute {attr!r} "
                             f"for dim {dim!r}", fix=f"point dim {dim!r} at the config attribute that holds its size, "
                                                    f"or give {attr} a small value under `tiny:`")
    return config


class _Builtins(Mapping):
    """``tiny-<family>`` -> family for every built-in architecture spec (read when first asked)."""

    def _names(self) -> dict[str, str]:
        return {f"tiny-{f}": f for f in builtin_families()}

    def __getitem__(self, name):
        return self._names()[name]

    def __iter__(self):
        return iter(self._names())

    def __len__(self):
        return len(self._names())


BUILTIN = _Builtins()


def model_arg_problem(model) -> tuple[str, str] | None:
    """(problem, fix) for a model argument that cannot name a model, found without the network;
    None when it may (a built-in name, an existing directory, a hub id ``org/name``, a bare name
    in the local hub cache). A path-like argument (``/``, ``.`` or ``~`` first, or more than one
    ``/``) must exist; a bare name that is no built-in must be in the hub cache (a hub id without
    an organization is looked up offline: it never waits for the network)."""
    import difflib
    from pathlib import Path
    builtins = ", ".join(sorted(BUILTIN))
    name = str(model)
    if name in BUILTIN:
        return None
    path = Path(name).expanduser()
    if path.exists():
        if path.is_dir():
            return None
        return (f"{name!r} is a file, not a model directory",
                "pass the directory that holds the model's config.json")
    if not isinstance(model, str) or name.startswith((".", "~", "/")) or name.count("/") > 1 or name.endswith("/"):
        return (f"no such directory: {str(path)!r}",
                f"check the path, or pass a built-in model ({builtins}) or a hub id (org/name)")
    if "/" in name:
        top, rest = name.split("/", 1)
        if Path(top).expanduser().is_dir() and not _in_hub_cache(name):    # a path into a local directory
            return (f"no such directory: {name!r} (the local directory {top + '/'!r} has no {rest!r})",
                    f"check the path (a local model's directory holds its config.json); a hub id whose "
                    f"organization is also a local directory's name loads from another working directory")
        return None            # org/name: a hub id, for from_pretrained
    if _in_hub_cache(name):
        return None
    close = difflib.get_close_matches(name, sorted(BUILTIN), n=1, cutoff=0.5)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return (f"{name!r} is not a built-in model, a local directory or a model in the hub cache",
            f"{hint}built-in models: {builtins}; give a hub model by its full id (org/name)")


def load_failure(name, error: BaseException) -> str:
    """What a failed ``from_pretrained`` of ``name`` says: for a name that is no local directory,
    that it is none, then the hub's answer (a mistyped local path is not only a hub error)."""
    from pathlib import Path
    first = str(error).strip().splitlines()[0].rstrip(".") if str(error).strip() else type(error).__name__
    if Path(str(name)).expanduser().exists():
        return first
    return f"no such directory: {str(name)!r}, and as a hub id: {first}"


def _in_hub_cache(repo_id: str) -> bool:
    """A model's config in the local hub cache (no network)."""
    try:
        from huggingface_hub import try_to_load_from_cache
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:       # an id the hub would refuse, no huggingface_hub: not cached
        return False


def build_tiny_model(name: str, seed: int = 0, dtype=None, attn_implementation: str = "sdpa"):
    """A built-in tiny model (``tiny-qwen3`` ...) with random weights from ``seed``."""
    import torch
    import transformers as tf
    if name not in BUILTIN:
        raise KeyError(f"unknown built-in model {name!r}; built-in models: {sorted(BUILTIN)}")
    config = tiny_config(BUILTIN[name])
    config._name_or_path = name
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32,
                                                attn_implementation=attn_implementation)
    return model.eval()


@lru_cache(maxsize=1)
def tiny_tokenizer():
    """A byte-level BPE tokenizer trained in-process on a small built-in corpus (left padding)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_TOKENIZER_VOCAB, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_CORPUS] * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   padding_side="left")


def check_on_tiny_model(arch, seed: int = 0) -> dict[str, int]:
    """Capture every site of architecture spec ``arch`` (a :class:`dmi.spec.Document` read from a
    file) from a real tiny model of its family, built from :func:`tiny_config`: a left-padded
    prefill of two prompts and two decode steps, eager attention. Every anchor must be found, every
    site's tensor must have the size its dims give, and every site must be computed; returns the
    rows stored per store group. A failure is a :class:`SpecError` naming the (first) site that
    fails alone, with the capture's error."""
    import tempfile
    from pathlib import Path

    import torch
    import transformers as tf

    from .api import load
    from .store.read import open_store
    from .errors import DmiError
    config = tiny_config(arch)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    enc = tiny_tokenizer()(["Hello world! How are you", "Paris"], return_tensors="pt", padding=True)

    def capture(sites: list[str], store: Path):
        hook = {"capture": [{"sites": sites}], "policy": {"ring_bytes": "64MiB"}}
        with torch.no_grad(), load(model, hook_spec=hook, store=store, arch_spec=arch.file) as run:
            run.model.generate(**enc, max_new_tokens=2, do_sample=False)
        return open_store(store)

    with tempfile.TemporaryDirectory(prefix="dmi-check-") as tmp:
        try:
            tree = capture(["*"], Path(tmp) / "all.zarr")
        except Exception as e:      # noqa: BLE001 - find the site that fails, and say so
            if isinstance(e, DmiError) and getattr(e, "file", None):
                raise
            for i, name in enumerate(arch.data["sites"]):
                try:
                    capture([name], Path(tmp) / f"{i}.zarr")
                except Exception as alone:      # noqa: BLE001
                    first = str(alone).strip().splitlines()[0] if str(alone).strip() else type(alone).__name__
                    raise arch.error(("sites", name, "hf"), f"site {name!r} fails in a real tiny {type(model).__name__}: "
                                     f"{type(alone).__name__}: {first}",
                                     fix=f"check its anchor against {type(model).__name__}'s forward (which assignment "
                                         f"of the variable, its axes in `layout`) and its dims against the config") from e
            raise
        never = list(tree.attrs.get("sites_never_computed", []))
        if never:
            raise arch.error(("sites", never[0]), f"site(s) {', '.join(never)} never computed in a tiny "
                             f"{type(model).__name__}: their anchor's code did not run",
                             fix="anchor them where this family's forward always passes (e.g. not inside a branch "
                                 "the config turns off)")
        return {node.path.strip("/"): node.dataset.sizes["token"] for node in tree.subtree
                if node.dataset.data_vars and "token" in node.dataset.sizes}
