"""Load the tokenizer (model folder or GGUF metadata) and what the engine needs to know of it."""

from __future__ import annotations

import os
from dataclasses import dataclass

import jinja2
from transformers import (
    AutoTokenizer,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from tokenmill.config import ModelConfig
from tokenmill.model.loader import is_gguf


def check_unicode(text: str, what: str) -> None:
    """ValueError for a lone UTF-16 surrogate (Python strings may hold one): the tokenizer's own error names no
    input ("TextEncodeInput must be Union[...]")."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} holds a lone surrogate ({text[e.start]!r} at character {e.start}), which is not "
                         "valid Unicode") from None


def load_tokenizer(model_config: ModelConfig, hf_config: PretrainedConfig | None = None) -> PreTrainedTokenizerBase:
    """`hf_config` (the model's) spares a GGUF tokenizer from re-parsing the file's metadata."""
    path = model_config.tokenizer or model_config.model
    template = model_config.chat_template
    if template is not None and not os.path.isfile(template):  # before the tokenizer's seconds of loading
        if os.path.isdir(template):
            raise ValueError(f"chat template {template!r} is a folder: pass the Jinja file itself")
        raise FileNotFoundError(f"chat template file {template!r} does not exist")
    if is_gguf(path):
        folder, name = os.path.split(os.path.abspath(path))
        if hf_config is not None and path == model_config.model:
            tokenizer = _gguf_tokenizer_class(hf_config).from_pretrained(folder, gguf_file=name)
        else:
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    else:
        _check_tokenizer_folder(path, given=model_config.tokenizer is not None)
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=model_config.trust_remote_code)
    if model_config.chat_template is not None:
        with open(model_config.chat_template) as f:
            tokenizer.chat_template = f.read()
        _check_template_syntax(tokenizer, model_config.chat_template)
    return tokenizer


def _check_template_syntax(tokenizer: PreTrainedTokenizerBase, template_file: str) -> None:
    """A --chat-template file that is no valid Jinja, refused at start-up: else the server starts and answers
    every chat request with a 400 blaming the request. Rendered once through transformers (whose Jinja
    extensions the template may use); errors the template raises on purpose depend on the conversation, so
    only a syntax error counts."""
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat template file {template_file!r} is not valid Jinja: {e.message} "
                         f"(line {e.lineno})") from None
    except Exception:  # a template may refuse this conversation, which is no syntax error
        pass


def _check_tokenizer_folder(path: str, given: bool) -> None:
    """A local path without tokenizer files, said in a line (transformers would try the Hub with it, or fail to
    build a tokenizer from nothing in a paragraph). A name that is no local path is left to transformers."""
    if not os.path.exists(path):
        if given and (os.path.isabs(path) or path.startswith((".", "~")) or path.count("/") > 1):
            raise FileNotFoundError(f"tokenizer path {path!r} does not exist")
        return
    if os.path.isfile(path):  # a GGUF went the other way; transformers would take the file for a Hub repo id
        raise FileNotFoundError(f"tokenizer path {path!r} is a file: pass the folder that holds tokenizer.json "
                                f"(and tokenizer_config.json), or a .gguf file")
    if os.path.isdir(path) and not any(name.startswith(("tokenizer", "vocab", "spiece", "tekken"))
                                       or name.endswith((".model", ".tiktoken")) for name in os.listdir(path)):
        where = "--tokenizer folder" if given else "model folder"
        raise FileNotFoundError(f"the {where} {path!r} has no tokenizer files (tokenizer.json, tokenizer_config.json, "
                                f"...): pass --tokenizer FOLDER, or --skip-tokenizer-init to give token ids")


def _gguf_tokenizer_class(hf_config: PretrainedConfig) -> type[PreTrainedTokenizerBase]:
    """The class AutoTokenizer picks for a GGUF of this model type: the family's own, else the
    generic fast one. NOTE: AutoTokenizer would first rebuild the config from the GGUF metadata, which
    is most of a GGUF tokenizer's load time (~3 s for SmolLM2), for a config we already have."""
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name

    name = TOKENIZER_MAPPING_NAMES.get(hf_config.model_type)
    # MistralCommonBackend reads Mistral's own tokenizer files, which a GGUF does not carry.
    if name is None or name == "MistralCommonBackend":
        return PreTrainedTokenizerFast
    return tokenizer_class_from_name(name) or PreTrainedTokenizerFast


@dataclass(frozen=True)
class TokenizerInfo:
    eos_token_ids: frozenset[int]


def _as_set(value) -> set[int]:
    if value is None:
        return set()
    return set(value) if isinstance(value, (list, tuple, set)) else {value}


def make_tokenizer_info(
    tokenizer: PreTrainedTokenizerBase | None, hf_config: PretrainedConfig, model_config: ModelConfig
) -> TokenizerInfo:
    """EOS ids from the tokenizer, the model config and generation_config.json (chat models often
    end turns with a token only the latter names)."""
    eos = _as_set(getattr(hf_config, "eos_token_id", None))
    if tokenizer is not None:
        eos |= _as_set(tokenizer.eos_token_id)
    if os.path.isdir(model_config.model):
        try:
            eos |= _as_set(GenerationConfig.from_pretrained(model_config.model).eos_token_id)
        except OSError:
            pass  # no generation_config.json
    return TokenizerInfo(eos_token_ids=frozenset(eos))
