"""Models named by Hugging Face Hub id: the one place `--model`, `--reranker` and `--embedder` values that are not
local paths become local ones.

A value that exists on disk is a local path and is returned as it is. Otherwise a value shaped like `org/name` (with
llama.cpp's quant selector, `org/name:Q4_K_M`, for a GGUF repository) is a Hub id: its files are fetched with
`huggingface_hub.snapshot_download` into the standard cache (HF_HOME / HF_HUB_CACHE), with its progress bar, under
its rules: HF_HUB_OFFLINE=1 reads the cache only, HF_TOKEN authenticates, HF_ENDPOINT names the Hub. Only what
tandem loads is fetched: a Hugging Face directory's config, tokenizer and weights (safetensors, else
pytorch_model*.bin), or one GGUF file of a GGUF repository (chosen by `--gguf-file`, by the quant selector, or the
only one; Q4_K_M among several, as llama.cpp's `-hf`). Anything else is a one-line `HubError` naming
`hf download <id>` and the local-path alternative.

Nothing here runs for the embedded defaults (`--model` unset, the embedded embedder): they download nothing.
"""
from __future__ import annotations

import fnmatch
import logging
import os
import re
import shlex
import threading
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("tandem.loader")

# org/name, optionally :QUANT (llama.cpp's -hf selector). Hub names: letters, digits, '-', '_', '.'.
_HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?::(?P<quant>[\w.-]+))?")
DEFAULT_QUANT = "Q4_K_M"  # llama.cpp's -hf default among a GGUF repository's files
# A Hugging Face directory: what the loaders read (config, tokenizer, sentence-transformers' modules and pooling,
# a chat template, a rerank template, the model card for a recipe's name), and its weights.
_DIRECTORY_FILES = ["*.json", "*.txt", "*.model", "*.jinja", "*.tiktoken", "README.md"]
_SKIPPED = ["onnx/*", "openvino/*", "coreml/*", "original/*", "*/onnx/*", "*/openvino/*"]


class HubError(FileNotFoundError):
    """A Hub id that cannot be made a local path; the message is one line that says what to do."""


@dataclass(frozen=True, slots=True)
class HubRef:
    repo_id: str
    quant: str | None = None  # a GGUF repository's file, by its quant name (org/name:Q4_K_M)


def parse(value: str | None) -> HubRef | None:
    """The Hub id `value` names, or None: a local path (it exists, or it is written as one) or not id-shaped. No
    network."""
    if not value:
        return None
    text = str(value)
    if text.startswith(("/", "./", "../", "~")) or os.path.exists(os.path.expanduser(text)):
        return None
    m = _HUB_ID.fullmatch(text)
    return HubRef(m["repo"], m["quant"]) if m else None


def display_name(value: str) -> str:
    """How a model given as `value` is named: a Hub id as written without its quant selector, else the path's last
    part."""
    ref = parse(value)
    return ref.repo_id if ref else Path(value).expanduser().resolve().name


_resolved: dict[tuple, str] = {}  # one process resolves an id once (the builder, recipes and encoders all ask)
_lock = threading.Lock()


def local_path(value: str, flag: str = "--model", revision: str | None = None, gguf_file: str | None = None) -> str:
    """`value` as a local path: itself when it is one (or not a Hub id: the loader names what is wrong with it),
    else the Hub id's files in the cache, downloaded when missing: the directory, or the one GGUF file. `flag`: how
    the user gave it, for messages; `revision`: a branch, tag or commit (None: main); `gguf_file`: the GGUF file of a
    repository holding several."""
    ref = parse(value)
    if ref is None:
        if gguf_file and os.path.isdir(os.path.expanduser(str(value))):
            return os.path.join(os.path.expanduser(str(value)), gguf_file)
        return value
    from huggingface_hub import constants

    key = (value, flag, revision, gguf_file, constants.ENDPOINT, constants.HF_HUB_CACHE, constants.is_offline_mode())
    with _lock:
        if key not in _resolved:
            _resolved[key] = str(_fetch(ref, flag, revision, gguf_file))
        return _resolved[key]


def _fetch(ref: HubRef, flag: str, revision: str | None, gguf_file: str | None) -> Path:
    from huggingface_hub import constants

    if gguf_file and ref.quant:
        raise HubError(f"{flag} {ref.repo_id}:{ref.quant} and --gguf-file {gguf_file}: give one of them")
    offline = constants.is_offline_mode()
    try:
        if gguf_file:
            patterns = [gguf_file]
        elif ref.quant:
            patterns = [_quant_pattern(ref.quant)]
        else:
            patterns = _patterns(ref, flag, _listing(ref, revision, offline))
        folder = _snapshot(ref, revision, patterns)
    except HubError:
        raise
    except Exception as exc:  # huggingface_hub's errors (and httpx's), one line each
        raise _explained(exc, ref, flag, revision, offline, gguf_file) from exc
    if len(patterns) == 1 and patterns[0].endswith(".gguf"):
        return _gguf_in(folder, patterns[0], ref, flag, gguf_file)
    return folder


def _listing(ref: HubRef, revision: str | None, offline: bool) -> list[str]:
    """The repository's files: the Hub's list, or offline, the cached snapshot's."""
    if not offline:
        import httpx2
        from huggingface_hub import HfApi
        from huggingface_hub.errors import OfflineModeIsEnabled

        try:
            return [s.rfilename for s in HfApi().model_info(ref.repo_id, revision=revision).siblings or []]
        except (httpx2.ConnectError, httpx2.TimeoutException, OfflineModeIsEnabled):
            pass  # no network: the cache's files, as snapshot_download falls back to them
    folder = _cached_snapshot(ref.repo_id, revision)
    if folder is None:
        from huggingface_hub.errors import LocalEntryNotFoundError

        raise LocalEntryNotFoundError(f"{ref.repo_id} is not in the cache")
    return [str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()]


def _cached_snapshot(repo_id: str, revision: str | None) -> Path | None:
    """The cached snapshot folder of `revision` (a ref's commit, or a commit itself), or None."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    storage = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model")
    revision = revision or "main"
    ref_file = storage / "refs" / revision
    commit = ref_file.read_text().strip() if ref_file.is_file() else revision
    folder = storage / "snapshots" / commit
    return folder if folder.is_dir() else None


def _patterns(ref: HubRef, flag: str, files: list[str]) -> list[str]:
    """What to fetch of a repository given without a GGUF selector: a Hugging Face directory's files, or a GGUF
    repository's one file (its only one, or Q4_K_M)."""
    if "config.json" in files:
        weights = ["*.safetensors"] if any(f.endswith(".safetensors") for f in files) else ["pytorch_model*.bin"]
        return _DIRECTORY_FILES + weights
    ggufs = sorted(f for f in files if f.endswith(".gguf"))
    if len(ggufs) == 1:
        return ggufs
    default = [f for f in ggufs if fnmatch.fnmatch(f, _quant_pattern(DEFAULT_QUANT))]
    if len(default) == 1:
        return default
    if ggufs:
        quants = ", ".join(_quant_names(ggufs))
        raise HubError(f"{flag} {ref.repo_id} holds {len(ggufs)} GGUF files: pick one with {ref.repo_id}:QUANT "
                       f"(one of {quants}) or --gguf-file FILE")
    raise HubError(f"{flag} {ref.repo_id} is neither a Hugging Face model directory (no config.json) nor a GGUF repository "
                   "(no .gguf file)")


def _quant_pattern(quant: str) -> str:
    """A case-blind glob for a GGUF file of `quant`: name-Q4_K_M.gguf, name.q4_k_m.gguf, ..."""
    blind = "".join(f"[{c.lower()}{c.upper()}]" if c.isalpha() else c for c in quant)
    return f"*[-._]{blind}.gguf"


def _quant_names(files: list[str]) -> list[str]:
    return [re.split(r"[-.]", Path(f).stem)[-1] for f in files]


def _snapshot(ref: HubRef, revision: str | None, patterns: list[str]) -> Path:
    from huggingface_hub import snapshot_download

    ignore = _SKIPPED + (["consolidated*.safetensors"] if "*.safetensors" in patterns else [])
    log.info("%s: fetching %s from the Hugging Face Hub into its cache (or finding them there)", ref.repo_id,
             ", ".join(patterns))
    return Path(snapshot_download(ref.repo_id, revision=revision, allow_patterns=patterns, ignore_patterns=ignore))


def _gguf_in(folder: Path, pattern: str, ref: HubRef, flag: str, gguf_file: str | None) -> Path:
    found = sorted(p for p in folder.rglob("*.gguf") if fnmatch.fnmatch(str(p.relative_to(folder)), pattern))
    if len(found) == 1:
        return found[0]
    what = f"--gguf-file {gguf_file}" if gguf_file else f"quant {ref.quant}" if ref.quant else pattern
    if not found:
        raise HubError(f"{flag} {ref.repo_id}: no GGUF file matches {what} in the repository")
    raise HubError(f"{flag} {ref.repo_id}: {len(found)} GGUF files match {what} ({', '.join(p.name for p in found)}; "
                   "split GGUF files are not served): pick one with --gguf-file FILE")


def _explained(exc: Exception, ref: HubRef, flag: str, revision: str | None, offline: bool,
               gguf_file: str | None) -> HubError:
    """One line for what went wrong fetching `ref`, with the two ways out: `hf download` where there is a network,
    or a local path."""
    from huggingface_hub import constants
    from huggingface_hub import errors

    # Every value the operator gave is quoted for a shell: the command is for copying and must run only itself.
    which = f" {shlex.quote(gguf_file)}" if gguf_file else \
        f" --include {shlex.quote(f'*{ref.quant}.gguf')}" if ref.quant else ""
    rev = f" --revision {shlex.quote(revision)}" if revision else ""
    download = f"`hf download {shlex.quote(ref.repo_id)}{which}{rev}`"
    # an LLM may be a GGUF file; a reranker or an embedder is an encoder's Hugging Face directory only
    local = f"or give a local path ({'a GGUF file or ' if flag == '--model' else ''}a Hugging Face model directory)"
    if isinstance(exc, errors.RevisionNotFoundError):
        return HubError(f"{flag} {ref.repo_id}: the Hub has no revision {revision!r} of it (a branch, tag or commit)")
    if isinstance(exc, (errors.GatedRepoError, errors.RepositoryNotFoundError)) or (
            isinstance(exc, errors.HfHubHTTPError) and getattr(exc.response, "status_code", None) == 401):
        from huggingface_hub import get_token

        token = "HF_TOKEN is set but does not grant access" if get_token() else \
            "a private or gated one needs HF_TOKEN"
        return HubError(f"{flag} {ref.repo_id}: no such model repository on {constants.ENDPOINT} ({token}); "
                        f"check the id, {local}")
    if isinstance(exc, errors.LocalEntryNotFoundError):
        why = "HF_HUB_OFFLINE=1" if offline else f"{constants.ENDPOINT} cannot be reached"
        return HubError(f"{flag} {ref.repo_id}: not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and {why}: "
                        f"run {download} where there is a network, {local}")
    text = " ".join(str(exc).split())[:300]
    return HubError(f"{flag} {ref.repo_id}: fetching it from {constants.ENDPOINT} failed ({type(exc).__name__}: "
                    f"{text}); run {download}, {local}")
