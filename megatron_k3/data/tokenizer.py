"""Tokenizers behind one small interface: a byte-level BPE (the `tokenizers` package: trained deterministically,
saved as tokenizer.json, with K3's media and chat control tokens right above its ids) or the released K3 tokenizer (a
directory with tiktoken.model and tokenizer_config.json, read with the `tiktoken` package).

Both give `encode(text, allow_special=False)` (ordinary text never becomes a special id unless allow_special),
`decode(ids)`, `token_to_id(name)`, `get_vocab_size()`, `encode_batch(texts)` (objects with `.ids`: the documents of the
data pipelines), `special_tokens` ({name: id}) and `eod_token`. `load_tokenizer(path)` takes either.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from pathlib import Path
from typing import Iterable, NamedTuple, Protocol

EOD_TOKEN = "<|endoftext|>"

# K3's chat control tokens (megatron_k3/data/chat.py writes the format with them), in the order the K3 release numbers
# them (its ids: 163586..163589, right after [BOS] and [EOS]).
K3_CONTROL_TOKENS = ("<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>")
# The special ids a BPE gets right above its vocabulary (the embedded one: 8192..8199, inside the 64 ids 8192..8255 that
# model.vocab_size=8256 reserves): first data=multimodal's media tokens (MediaTokens.after(placeholder) with the
# placeholder = the vocabulary size, as model.vision.placeholder_token_id=8192 in k3_vl_tiny), named as the K3 release
# names them (its media_placeholder_token_id is <|media_pad|>), then the chat control tokens.
BPE_SPECIAL_TOKENS = ("<|media_pad|>", "<|media_begin|>", "<|media_end|>", "<|pad|>") + K3_CONTROL_TOKENS
# Other names of those ids: the release's chat renders each image as <|kimi_image_placeholder|>, which the serving
# stack replaces by the media run; a BPE reads it as the model's placeholder id at once.
BPE_SPECIAL_ALIASES = {"<|kimi_image_placeholder|>": "<|media_pad|>"}

# The released K3 tokenizer: its text split (Han runs, words with their case and English contractions, up to three
# digits, punctuation runs, newlines, spaces) and the 256 special ids it reserves right after the base vocabulary.
_LETTERS_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_LETTERS_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
K3_PATTERN = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?" + _LETTERS_UPPER + "*" + _LETTERS_LOWER + "+" + _CONTRACTIONS,
    r"[^\r\n\p{L}\p{N}]?" + _LETTERS_UPPER + "+" + _LETTERS_LOWER + "*" + _CONTRACTIONS,
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
K3_RESERVED_SPECIAL = 256
# tiktoken's Rust core panics on very long inputs and on very long runs of spaces or of non-spaces, so text goes in
# windows and long runs are cut, exactly where the release cuts them (the cuts decide the ids).
_WINDOW_CHARS = 400_000
_MAX_RUN_CHARS = 25_000


class Encoded(NamedTuple):
    ids: list


class TextTokenizer(Protocol):
    """What encode_chat and the data pipelines need of a tokenizer."""
    special_tokens: dict
    eod_token: str

    def encode(self, text: str, allow_special: bool = False) -> list: ...
    def decode(self, ids) -> str: ...
    def token_to_id(self, name: str) -> int | None: ...
    def get_vocab_size(self) -> int: ...
    def encode_batch(self, texts, **kwargs) -> list: ...


def train_bpe(texts: Iterable[str], vocab_size: int, out_path: Path):
    """Train a byte-level BPE with one special token (end of document, id 0) and save it as
    tokenizer.json. Single-threaded training is deterministic for the same texts in the same order.
    Returns the `tokenizers.Tokenizer` (load_tokenizer(out_path) gives it with the special tokens above it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOD_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_suffix(".tmp")
    tok.save(str(tmp))
    tmp.replace(out_path)
    return tok


def _special_splitter(names) -> re.Pattern:
    """Matches any of `names`, the longest first."""
    return re.compile("|".join(re.escape(n) for n in sorted(names, key=len, reverse=True)))


class BPETokenizer:
    """A `tokenizers` BPE (a tokenizer.json) with BPE_SPECIAL_TOKENS at get_vocab_size() upward (those the file does
    not define itself). get_vocab_size() stays the file's: the data pipelines' ids and checks are unchanged."""

    def __init__(self, tok):
        from tokenizers import Tokenizer

        self._tok = tok
        self._plain = Tokenizer.from_str(tok.to_str())  # the same BPE reading every added token as ordinary text
        self._plain.encode_special_tokens = True
        own = {t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special}
        base = tok.get_vocab_size()
        above = {name: base + i for i, name in enumerate(BPE_SPECIAL_TOKENS) if tok.token_to_id(name) is None}
        above.update({alias: above[name] for alias, name in BPE_SPECIAL_ALIASES.items()
                      if name in above and tok.token_to_id(alias) is None})
        self.special_tokens = {**own, **above}
        self._names = {}
        for name, i in self.special_tokens.items():  # decode shows the first name of an id
            self._names.setdefault(i, name)
        self._splitter = _special_splitter(self.special_tokens)
        self.eod_token = EOD_TOKEN

    @classmethod
    def from_file(cls, path: str | Path) -> "BPETokenizer":
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_file(str(path)))

    def encode(self, text: str, allow_special: bool = False) -> list:
        if not allow_special:
            return self._plain.encode(text, add_special_tokens=False).ids
        ids, pos = [], 0
        for m in self._splitter.finditer(text):
            if m.start() > pos:
                ids += self._plain.encode(text[pos:m.start()], add_special_tokens=False).ids
            ids.append(self.special_tokens[m.group()])
            pos = m.end()
        if pos < len(text):
            ids += self._plain.encode(text[pos:], add_special_tokens=False).ids
        return ids

    def encode_batch(self, texts, **kwargs) -> list:
        """The data pipelines' documents, encoded as `tokenizers` always did (the file's own added tokens, such as
        <|endoftext|>, are matched in the text; the special tokens above the vocabulary are not)."""
        return self._tok.encode_batch(list(texts), **kwargs)

    def decode(self, ids) -> str:
        """Text of `ids`; special ids as their names."""
        out, run = [], []
        for i in [ids] if isinstance(ids, int) else ids:
            if i in self._names:
                out += [self._tok.decode(run), self._names[i]] if run else [self._names[i]]
                run = []
            else:
                run.append(int(i))
        return "".join(out + ([self._tok.decode(run)] if run else []))

    def token_to_id(self, name: str) -> int | None:
        i = self.special_tokens.get(name)
        return self._tok.token_to_id(name) if i is None else i

    def get_vocab_size(self) -> int:
        return self._tok.get_vocab_size()


def _read_tiktoken_model(path: Path) -> dict:
    """{token bytes: rank} of a tiktoken.model (each line: the token's bytes in base64, a space, its rank). Parsed
    here: tiktoken.load caches what it reads by path, so a file changed in place would be read stale."""
    if not path.is_file():
        raise FileNotFoundError(f"K3 tokenizer file not found: {path}")
    ranks = {}
    for n, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise ValueError(f"{path}:{n}: not a tiktoken.model line (base64 token, space, rank): "
                             f"{line[:60].decode('latin-1')!r}") from None
    if not ranks:
        raise ValueError(f"{path}: no tokens")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: the ranks are not 0..{len(ranks) - 1}, each once")
    return ranks


def _read_special_names(path: Path, base: int) -> tuple:
    """({id: name} of tokenizer_config.json's added_tokens_decoder, its eos_token), the ids checked against the
    reserved range base..base+255."""
    if not path.is_file():
        raise FileNotFoundError(f"K3 tokenizer file not found: {path}")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
        names = {int(i): t["content"] for i, t in config.get("added_tokens_decoder", {}).items()}
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise ValueError(f"{path}: not a tokenizer config with added_tokens_decoder {{id: {{content}}}}: "
                         f"{' '.join(str(e).split())}") from None
    outside = sorted(i for i in names if not base <= i < base + K3_RESERVED_SPECIAL)
    if outside:
        raise ValueError(f"{path}: added_tokens_decoder names id {outside[0]}, outside the special ids {base}.."
                         f"{base + K3_RESERVED_SPECIAL - 1} (right after tiktoken.model's {base} tokens)")
    eos = config.get("eos_token", "[EOS]")
    return names, eos["content"] if isinstance(eos, dict) else str(eos)


def _cut_long_runs(text: str):
    """`text` in pieces with no run of spaces or of non-spaces over _MAX_RUN_CHARS (a longer run is cut every
    _MAX_RUN_CHARS characters, counted from its start)."""
    if len(text) <= _MAX_RUN_CHARS:
        yield text
        return
    start, run, space = 0, 0, text[0].isspace()
    for i, ch in enumerate(text):
        if ch.isspace() != space:
            run, space = 1, not space
            continue
        run += 1
        if run > _MAX_RUN_CHARS:
            yield text[start:i]
            start, run = i, 1
    yield text[start:]


class K3Tokenizer:
    """The released K3 tokenizer of a directory: tiktoken.model (the base vocabulary) and tokenizer_config.json (the
    names of the 256 special ids after it; unnamed ones are <|reserved_token_{id}|>)."""

    def __init__(self, directory: str | Path):
        import tiktoken

        d = Path(directory)
        self._ranks = _read_tiktoken_model(d / "tiktoken.model")
        base = len(self._ranks)
        names, self.eod_token = _read_special_names(d / "tokenizer_config.json", base)
        self.special_tokens = {names.get(i, f"<|reserved_token_{i}|>"): i
                               for i in range(base, base + K3_RESERVED_SPECIAL)}
        self._enc = tiktoken.Encoding(name=str(d), pat_str=K3_PATTERN, mergeable_ranks=self._ranks,
                                      special_tokens=self.special_tokens)

    def encode(self, text: str, allow_special: bool = False) -> list:
        ids = []
        for w in range(0, len(text), _WINDOW_CHARS):
            for piece in _cut_long_runs(text[w:w + _WINDOW_CHARS]):
                if allow_special:
                    ids += self._enc.encode(piece, allowed_special="all")
                else:
                    ids += self._enc.encode(piece, allowed_special=set(), disallowed_special=())
        return ids

    def encode_batch(self, texts, **kwargs) -> list:
        """Ordinary text (no special ids); keyword arguments of `tokenizers`' encode_batch are accepted and ignored."""
        return [Encoded(self.encode(t)) for t in texts]

    def decode(self, ids) -> str:
        return self._enc.decode([ids] if isinstance(ids, int) else [int(i) for i in ids])

    def token_to_id(self, name: str) -> int | None:
        i = self.special_tokens.get(name)
        return self._ranks.get(name.encode("utf-8")) if i is None else i

    def get_vocab_size(self) -> int:
        return self._enc.n_vocab


def load_tokenizer(path: str | Path):
    """A tokenizer.json (BPETokenizer) or a K3 tokenizer directory (K3Tokenizer)."""
    path = Path(path)
    if path.is_dir():
        return K3Tokenizer(path)
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file not found: {path}")
    return BPETokenizer.from_file(path)


def eod_id(tok) -> int:
    name = getattr(tok, "eod_token", EOD_TOKEN)
    i = tok.token_to_id(name)
    if i is None:
        raise ValueError(f"tokenizer has no end-of-document token {name!r}")
    return i
