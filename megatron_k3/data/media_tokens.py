"""The ids of a medium in a data=multimodal sample: `<|media_begin|>`, the model's placeholder once per feature row,
`<|media_end|>`, and the padding id, just above the text tokenizer's ids (`media_tokens_for` checks them against the
model), and the text encoder (`tokenizer_encoder`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..errors import ConfigError

__all__ = ["MediaTokens", "media_tokens_for", "media_tokens_of", "tokenizer_encoder"]


@dataclass(frozen=True)
class MediaTokens:
    """The ids around and inside a medium's run, and the padding id; the placeholder is the model's."""
    placeholder: int
    begin: int
    end: int
    pad: int

    @classmethod
    def after(cls, placeholder: int) -> "MediaTokens":
        """placeholder, <|media_begin|> = placeholder + 1, <|media_end|> = + 2, <|pad|> = + 3."""
        return cls(placeholder, placeholder + 1, placeholder + 2, placeholder + 3)

    @property
    def ids(self) -> tuple:
        return self.placeholder, self.begin, self.end, self.pad


def media_tokens_for(model, text_vocab: int) -> MediaTokens:
    """The media ids for `model` (a ModelConfig) over a tokenizer of `text_vocab` ids, or a ConfigError naming the
    key to change."""
    v = model.vision
    if not v.enabled:
        raise ConfigError("model.vision.enabled", False, "data=multimodal needs a model with a vision tower "
                          "(e.g. model=k3_vl_tiny)")
    t = MediaTokens.after(v.placeholder_token_id)
    if t.placeholder < text_vocab:
        raise ConfigError("model.vision.placeholder_token_id", t.placeholder,
                          f"must be >= the tokenizer's vocabulary ({text_vocab}): data=multimodal uses ids "
                          f"{t.placeholder}..{t.pad} for the media tokens, above the text ids")
    if t.pad >= model.vocab_size:
        raise ConfigError("model.vocab_size", model.vocab_size,
                          f"must be > {t.pad}: data=multimodal uses {t.placeholder} (placeholder), {t.begin} "
                          f"<|media_begin|>, {t.end} <|media_end|> and {t.pad} <|pad|>")
    return t


def media_tokens_of(model, tokenizer, pad: int) -> MediaTokens:
    """The media ids of a vision model with `tokenizer`: the tokenizer's own `<|media_pad|>` (the model's
    placeholder), `<|media_begin|>`, `<|media_end|>` and `<|pad|>` (else `pad`) when it names them with that
    placeholder (the release's tokenizer, the BPEs of data/tokenizer.py), else `media_tokens_for`'s ids above its
    vocabulary."""
    sp = getattr(tokenizer, "special_tokens", {})
    if sp.get("<|media_pad|>") == model.vision.placeholder_token_id and "<|media_begin|>" in sp \
            and "<|media_end|>" in sp and model.vision.enabled:
        return MediaTokens(sp["<|media_pad|>"], sp["<|media_begin|>"], sp["<|media_end|>"], sp.get("<|pad|>", pad))
    return media_tokens_for(model, tokenizer.get_vocab_size())


def tokenizer_encoder(tok) -> Callable:
    """texts -> lists of ids, for a `tokenizers.Tokenizer`."""
    return lambda texts: [e.ids for e in tok.encode_batch(list(texts))]
